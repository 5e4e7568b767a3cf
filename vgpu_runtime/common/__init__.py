"""Small pieces every daemon and command of gemini.ai/vgpu uses."""
