"""The host daemon (gemini-host): one node daemon for every user of a machine without Kubernetes.

An administrator installs it once (`gemini-host install`: a systemd unit, the group `gemini`);
gemini-run and gemini-vgpu find it by its mark in /var/lib/gemini (vgpu_runtime/hoststate.py).
It is the node daemon (daemon.py: records, channels, tokens, the memory ledger) with, around it:
`server.py`, the socket every member of the group reaches (allocate, status, release), which
knows each user by the connection's peer credentials and writes the allocation records itself;
`admission.py`, which admits across users from the one ledger of records; `view.py`, what each
user is shown; `main.py`, start-up and its refusals; `config.py`, its settings.
"""
