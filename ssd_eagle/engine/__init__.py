"""The decoding engine: sequences, detokenization, the step-based :class:`LLMEngine` and the blocking :class:`LLM`."""
