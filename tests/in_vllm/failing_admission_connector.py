"""The connector with a scheduler whose admission of a loading request raises once it has queued everything (as a bug
would, at the worst moment): vLLM has agreed to skip the loaded tokens, so they must be recomputed, never served
unwritten or half-planned, and the engine must go on."""

from peft_kvcache.vllm.connector import PeftKVCacheConnector as _Connector


class PeftKVCacheConnector(_Connector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.scheduler is not None:
            admit = self.scheduler._admit

            def admit_then_fail(request, plan, block_ids, num_external_tokens):
                admit(request, plan, block_ids, num_external_tokens)
                if num_external_tokens:
                    raise RuntimeError("a failing admission (tests/in_vllm/failing_admission_connector.py)")

            self.scheduler._admit = admit_then_fail
