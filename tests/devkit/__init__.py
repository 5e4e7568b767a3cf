"""Tests of the development kit (vgpu_runtime/devkit): the kubelet emulator, its runtime."""
