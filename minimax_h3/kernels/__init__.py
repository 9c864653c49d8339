"""The kernels behind the layers: the start-up registry that picks them, int8 ConvRot, fp8, NVFP4, Triton."""
