"""Scripts beside the package; a package only so the benchmarks share scripts/benchkit.py."""
