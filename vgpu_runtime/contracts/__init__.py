"""The contracts between the node's programs (the device plugin, gemini-run, the node daemon, the
interposer): one file each, listed in README.md. They name what the build made and never build
it (tests/test_layering.py)."""
