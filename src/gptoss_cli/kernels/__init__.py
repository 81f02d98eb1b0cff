"""Triton kernels for gpt-oss on Hopper, each with a plain-torch twin that defines its meaning.

The runtime imports kernels only through this package.
"""
