#!/usr/bin/env python3
"""Requantizes a GGUF model with llama.cpp (llama-cpp-python's llama_model_quantize, requantizing
allowed) into the types people download: F16, Q8_0, Q6_K, Q4_K_M (and Q5_K_M, which the engine
refuses: it has no Q5_K). The default model's 576-wide rows are not a multiple of 256, so
llama.cpp's K-quant recipes fall back to Q5_0 / Q5_1 / Q8_0 for most of its tensors.

Usage: requantize.py SRC.gguf OUT_DIR   (writes OUT_DIR/<stem>.<TYPE>.gguf)
"""
import ctypes, os, sys

import llama_cpp

src, out_dir = sys.argv[1:3]
stem = os.path.basename(src).rsplit(".", 2)[0]
# llama_ftype values (llama.h): MOSTLY_F16 1, MOSTLY_Q8_0 7, MOSTLY_Q4_K_M 15, MOSTLY_Q5_K_M 17, MOSTLY_Q6_K 18
for name, ftype in [("F16", 1), ("Q8_0", 7), ("Q6_K", 18), ("Q4_K_M", 15), ("Q5_K_M", 17)]:
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.allow_requantize = True
    out = os.path.join(out_dir, f"{stem}.{name}.gguf")
    if llama_cpp.llama_model_quantize(src.encode(), (out + ".part").encode(), ctypes.byref(p)) != 0:
        sys.exit(f"llama_model_quantize failed for {name}")
    os.replace(out + ".part", out)
    print(out)
