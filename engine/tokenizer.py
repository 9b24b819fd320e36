"""Tokenizers behind one small interface: encode, decode, vocabulary, special ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then BOS and EOS. Used by `random:<preset>` models and the
    simulated executor; decoding never fails (invalid UTF-8 is replaced)."""

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < 258:
            raise ValueError(f"a byte-level tokenizer needs vocab_size >= 258, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id: int | None = 256
        self.eos_token_ids: tuple[int, ...] = (257,)
        self.chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [256, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library, with the special tokens
    and chat template of `tokenizer_config.json` when the folder has one."""

    def __init__(self, tokenizer_file: str | Path, config: dict[str, Any] | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tokenizer = _Tokenizer.from_file(str(tokenizer_file))
        config = config or {}
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._special_id(config.get("bos_token"))
        eos = self._special_id(config.get("eos_token"))
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (eos,)
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path}: file not found (a fast tokenizer.json is required)")
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(path, config)

    def _special_id(self, token: object) -> int | None:
        if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer_config files
            token = token.get("content")
        return self._tokenizer.token_to_id(token) if isinstance(token, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))
