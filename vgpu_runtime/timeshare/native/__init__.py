"""The token scheduler in C (timeshare.h), and its build recipe; the binding is
vgpu_runtime.timeshare.nativepolicy."""
