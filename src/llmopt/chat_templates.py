"""Chat templates: a model's own, the user's, or its architecture family's known one, so a chat
request never meets vLLM's bare "no chat template" error."""

from __future__ import annotations

import json
from pathlib import Path

from llmopt.errors import LlmoptError

FOLDER = Path(__file__).parent / "data" / "chat_templates"
FILE = "chat_template.jinja"  # where transformers and vLLM look in a model folder
# Families whose instruction-tuned models share one template, by the architecture's name prefix.
FAMILIES = {"Qwen2": "chatml", "Qwen3": "chatml", "Gemma": "gemma", "Mistral": "mistral", "Mixtral": "mistral", "Phi3": "phi3"}


def present(folder: Path) -> bool:
    """Whether a model folder carries a chat template (its own file, or in its tokenizer config)."""
    if (folder / FILE).is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def family(architecture: str | None) -> str | None:
    return next((name for prefix, name in FAMILIES.items() if architecture and architecture.startswith(prefix)), None)


def read(path: Path) -> str:
    """A user's template, checked to render a conversation."""
    import jinja2

    try:
        text = path.read_text()
        jinja2.Environment().from_string(text).render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                      bos_token="", eos_token="")
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmoptError(f"cannot read chat template '{path}' ({type(exc).__name__})", "pass a Jinja template file") from None
    except jinja2.TemplateError as exc:
        raise LlmoptError(f"chat template '{path}' does not render ({exc})", "fix the template") from None
    return text


def fill(folder: Path, architecture: str | None, given: Path | None) -> str | None:
    """Give a model folder a chat template: the user's, else its own, else its family's. Returns
    where it came from ("user", "model", "family:NAME"), or None when it has none."""
    if given is not None:
        (folder / FILE).write_text(read(given))
        return "user"
    if present(folder):
        return "model"
    name = family(architecture)
    if name is None:
        return None
    (folder / FILE).write_text((FOLDER / f"{name}.jinja").read_text())
    return f"family:{name}"
