"""The CPU's kernels in C, for x86 with AVX2/FMA, each source beside the module that builds and
calls it (`cbuild.py` compiles them once into the cache and loads them):

* `cpu_linear` (cpu_linear.c): linear layers, weight-only int8 and float32 (GGUF blocks);
* `layer_ops` (layer_ops.c): a layer's RMS norm, rotary embedding and MLP activation, the
  vocabulary argmax and top-k log-probabilities, KV slot moves; greedy verification of draft
  trees through host_ops.c, an extension module;
* `cpu_attention` (paged_attention.c): paged attention for decode and verify rows;
* `decoder` (decoder.c): a float32 model's decoder layers over a step in one call, through
  the kernels above.

simd.h and pylists.h are the headers they share. Each module's `available()` says whether it
runs here; importing one builds nothing.
"""
