"Speculative decoding for MLX, written as a literate nbdev package."
__version__ = "0.0.1"
