"""gemini.ai/vgpu device plugin: every GPU as N `gemini.ai/vgpu` slices for kubelet."""
