"""The development kit the demo, the benchmarks and the tests share: the kubelet emulator and its
runc runtime stage, the fake libcuda and NVML, the fake Kubernetes API and node harnesses that run
the real plugin and daemon. The product never imports it (tests/test_layering.py)."""
