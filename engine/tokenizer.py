"""Tokenizer from tokenizer.json, chat template from tokenizer_config.json (as DeepSeek ships them)."""

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value

LONG_TEXT_CHARS = 16 << 10


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered with the model's chat template."""


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(cfg.get("add_bos_token", True)) and self.bos_token_id is not None
        self.chat_template = cfg.get("chat_template")
        self._template = None
        self.chat_template_variables: frozenset[str] = frozenset()  # what the template reads (`tools`, `thinking`)
        if self.chat_template:
            # the environment transformers renders chat templates in, so a template renders the same in both
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)
            self.chat_template_variables = frozenset(meta.find_undeclared_variables(env.parse(self.chat_template)))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # a long text through encode_batch: it releases the GIL while it works (encode holds it, ~2 s
        # for 5 MB), so the server's event loop runs on meanwhile; a short one costs less through encode
        if len(text) > LONG_TEXT_CHARS:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation to the prompt text (it carries its own BOS: encode with add_bos=False)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json has no chat_template)")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"cannot render the conversation with the chat template: {e}") from e
        except (TypeError, KeyError) as e:
            raise ChatTemplateError(f"malformed conversation for the chat template: {e}") from e


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise TemplateError(message)
