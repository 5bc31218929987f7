"""Byte-level BPE tokenizer built from GGUF metadata (``tokenizer.ggml.*``) with ``tokenizers``.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported. The pre-tokenizer
splits digits one by one and then applies the GPT-2 byte-level regex, as llama.cpp does for
``tokenizer.ggml.pre`` values "smollm" / "starcoder"; control tokens (``token_type == 3``,
e.g. ``<|im_start|>``) are special tokens that are never split.

BOS: ``encode`` prepends ``bos_token_id`` only when the GGUF says ``tokenizer.ggml.add_bos_token``
is true (SmolLM2: false, so plain prompts are encoded as is).

Text versus control tokens: ``encode(text)`` turns control-token text written in ``text`` (say
``<|im_start|>``) into the control token -- that is how a caller writes a template by hand.
``encode_chat(prompt)`` does not: only the chat template's own markers become control tokens,
and the user's prompt is encoded as the characters it contains (``encode(prompt,
parse_special=False)``), so a prompt cannot close its turn or forge a system turn.
"""

from __future__ import annotations

GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4


class GGUFTokenizer:
    """``encode(text) -> list[int]``, ``decode(ids) -> str`` plus bos/eos/stop token ids."""

    def __init__(self, metadata: dict[str, object]):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported tokenizer.ggml.model {kind!r} (only 'gpt2': "
                             "byte-level BPE)")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        token_types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))

        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if metadata.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
            pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
        tok.decoder = decoders.ByteLevel()
        special = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, tt in enumerate(token_types)
            if tt in (GGUF_TOKEN_TYPE_CONTROL, GGUF_TOKEN_TYPE_USER_DEFINED)
        ]
        tok.add_special_tokens(special)
        self._tok = tok
        self.vocab_size = len(tokens)
        self.bos_token_id = _opt_int(metadata.get("tokenizer.ggml.bos_token_id"))
        self.eos_token_id = _opt_int(metadata.get("tokenizer.ggml.eos_token_id"))
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template = metadata.get("tokenizer.chat_template")
        # Generation stops at eos; "<|endoftext|>" also ends a plain-text continuation.
        stops = {self.eos_token_id, vocab.get("<|endoftext|>")}
        self.stop_token_ids = frozenset(i for i in stops if i is not None)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True
               ) -> list[int]:
        """Token ids of ``text``. ``parse_special``: control-token text in ``text`` becomes the
        control token (True) or is encoded as ordinary characters (False)."""
        self._tok.encode_special_tokens = not parse_special
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False
        add_bos = self.add_bos_token if add_bos is None else add_bos
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, prompt: str) -> str:
        """One user turn in the ChatML format of SmolLM2's template (default system prompt,
        then the assistant generation prompt), as text. Raises ``ValueError`` if the GGUF
        template is not ChatML. To tokenize it, use :meth:`encode_chat` (``encode`` of this text
        would also turn control-token text inside ``prompt`` into control tokens)."""
        return "".join(text for text, _ in self._chat_segments(prompt))

    def encode_chat(self, prompt: str) -> list[int]:
        """Token ids of :meth:`apply_chat_template` ``(prompt)`` where only the template's
        markers are control tokens: text between them (the user's prompt included) is encoded
        with ``parse_special=False``. For a prompt without control-token text this equals
        ``encode(apply_chat_template(prompt))``."""
        ids = []
        for text, control in self._chat_segments(prompt):
            ids += self.encode(text, add_bos=False, parse_special=control)
        add_bos = self.add_bos_token and self.bos_token_id is not None
        return [self.bos_token_id] + ids if add_bos else ids

    def _chat_segments(self, prompt: str) -> list[tuple[str, bool]]:
        """The template as ``(text, is_control_token)`` pieces; the text between two control
        tokens is one piece, as the tokenizer splits it when it reads the whole string."""
        if not self.chat_template or "<|im_start|>" not in self.chat_template:
            raise ValueError("the GGUF has no ChatML chat template")
        system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        if system not in self.chat_template:
            raise ValueError("unrecognised chat template; pass a plain prompt")
        start, end = ("<|im_start|>", True), ("<|im_end|>", True)
        return [start, (f"system\n{system}", False), end, ("\n", False),
                start, (f"user\n{prompt}", False), end, ("\n", False),
                start, ("assistant\n", False)]


def _opt_int(value) -> int | None:
    return None if value is None else int(value)
