"""NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) language towers run by PyTorch.

``format`` is the number format itself (E2M1 codes, e4m3 block scales, fp32 global scales), and
``kernels`` the Linear layer that multiplies by such a weight, natively on Blackwell or through a
dequantizing fallback anywhere else.
"""
