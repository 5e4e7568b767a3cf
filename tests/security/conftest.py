"""The hook's fixtures (the interposer built strict, the fake driver) for the attacks here."""

from tests.hook.conftest import fake_dir, hook_lib, hooked  # noqa: F401 (fixtures)
