"""Token counts with the model's own tokenizer (never words), and the failures counted as such."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError


class TokenCounter:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str | Path) -> "TokenCounter":
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(str(path)))
        except Exception as exc:
            raise LlmoptError(f"cannot load a tokenizer from '{path}' ({type(exc).__name__})", "pass --tokenizer with the model's folder") from exc

    def prompt_ids(self, messages: tuple[dict[str, str], ...] | list[dict[str, str]]) -> list[int]:
        """The tokens the server sees for a chat request, chat template applied."""
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt_tokens(self, messages: tuple[dict[str, str], ...] | list[dict[str, str]]) -> int | None:
        """How many of them; None if the template or the tokenizer fails."""
        try:
            return len(self.prompt_ids(messages))
        except Exception:
            return None

    def output_tokens(self, text: str) -> int | None:
        try:
            return len(self.tokenizer(text, add_special_tokens=False).input_ids)
        except Exception:
            return None
