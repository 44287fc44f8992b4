# Names the dead-code check (vulture, in .ci/run) must not report: each is
# used from outside what it scans (kvcore, tests, bench).
# transformers calls these on a Cache (kvcore/hf/cache.py: its Cache protocol)
_.is_compileable
_.is_croppable
_.is_sliding
_.lazy_initialization
_.get_max_length
_.get_max_cache_shape
_.reorder_cache
_.offload
_.prefetch
_.batch_select_indices
# read by the native pool (kvcore/_native/_pool.pyx: a cdef public field)
_.publish_evictions
# read by transformers' generate (a GenerationConfig field)
_.eos_token_id
# set on a tokenizers.Tokenizer (kvcore/cli/llama.py): read by the library
_.pre_tokenizer
_.decoder
# read by inspect.signature (kvcore/hf/generation.py: the graph runner shows the forward's)
_.__signature__
# set on a CuPy RawKernel (cuFuncSetAttribute: kvcore/backends/cuda/backend.py)
_.max_dynamic_shared_size_bytes
