"""How a build's weights are stored: the quantized formats (quantize), each core's
weight stream, vector slabs and expert pieces cut from the model's tensors (pack), their
inverse in jax.numpy for the runner's prefill (unpack), and `mkgen convert`'s per-core
containers with the reader that checks them (convert).

The weight inventory (which tensors a model has) is mkgen/spec/weights.py; placing
converted weights on a mesh is mkgen/runtime/weights.py. This package sits between the
plan, whose layout says where every byte goes, and the code that reads them.
"""
