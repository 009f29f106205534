"""The connector as a vLLM release that never hands it the block pool would run it (`bind_gpu_block_pool` is a
recent hook): mapped blocks could not be evicted from vLLM's prefix cache, so nothing may be mapped."""

from peft_kvcache.vllm.connector import PeftKVCacheConnector as _Connector


class PeftKVCacheConnector(_Connector):
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        pass  # never told
