"""Qwen3.5 chat templates: the official inference template and Kiln's SFT training template.

docs/tokenization.md#templates.

- `qwen3_5_chat_template.jinja` is the model's own artifact (the official Qwen3.5 think template,
  byte-identical to TRL's `qwen3_5_think.jinja`). A checkpoint whose chat_template differs is
  not the pinned Qwen3.5 template and is refused (`select_training_template`).
- `qwen3_5_training.jinja` is Kiln's training variant: it renders byte-identically to TRL's
  `qwen3_5_think_training.jinja` and carries one Hugging Face `{% generation %}` block per
  assistant turn. That file IS the marker-free effective template: Transformers renders it with
  `return_assistant_tokens_mask=True` as-is (the oracle does), and
  `training_chat_template_sha256` is the SHA-256 of its bytes.
- Kiln's own jinja environment implements the `generation` tag as a pair of internal span
  markers (two Unicode noncharacters, reserved by the standard for process-internal use) around
  the block's output. `render` removes them and returns the marker-free text plus the character
  spans they enclosed; loss spans come from the markers only, never from searching the text.

The environment matches Transformers' chat-template environment: immutable sandbox,
`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, and a `tojson` filter that is
`json.dumps(x, ensure_ascii=False)` with the default separators (", ", ": ").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln_train.data.tokenizer import TOKENIZER_CONFIG_FILE
from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError, backend_unsupported
from kiln_train.ground.digest import text_sha256_hex

# A model directory's own template, beside its tokenizer files.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = Path(__file__).parent / "templates"
INFERENCE_TEMPLATE_FILE = TEMPLATE_DIR / "qwen3_5_chat_template.jinja"
# The template Qwen3.5-2B and smaller ship (TRL's `qwen3_5_nothink.jinja`): the think template with
# the generation prompt's default inverted (an empty think block unless enable_thinking=True).
NOTHINK_TEMPLATE_FILE = TEMPLATE_DIR / "qwen3_5_nothink_chat_template.jinja"
TRAINING_TEMPLATE_FILE = TEMPLATE_DIR / "qwen3_5_training.jinja"

# Internal span markers: Unicode noncharacters, never valid in interchanged text. Any occurrence
# in a row's data fails that row (conversation.py) before rendering; `render` re-checks the output.
SPAN_OPEN = "\ufdd0"
SPAN_CLOSE = "\ufdd1"


class TemplateRenderError(ValueError):
    """The template refused the conversation (e.g. no user query) or the span markers are malformed."""


@dataclass(frozen=True)
class RenderedConversation:
    """Marker-free rendered text and the supervised character spans `[start, end)` in it."""

    text: str
    spans: tuple[tuple[int, int], ...]


class _GenerationSpans(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` -> SPAN_OPEN + body + SPAN_CLOSE."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        return SPAN_OPEN + caller() + SPAN_CLOSE


def _raise_exception(message: str):
    raise TemplateRenderError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's built-in tojson HTML-escapes; chat templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationSpans, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def extract_spans(marked: str, expected: int | None = None) -> RenderedConversation:
    """Strip the span markers from `marked`; spans are in marker-free character coordinates.

    Markers must alternate OPEN, CLOSE (no nesting, none left open); with `expected`, exactly that
    many spans must be present. A violation means a marker came from somewhere other than the
    template, so the conversation is refused.
    """
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0  # read position in `marked`
    out_len = 0  # length of the marker-free text so far
    while True:
        i = marked.find(SPAN_OPEN, pos)
        if i < 0:
            tail = marked[pos:]
            if SPAN_CLOSE in tail:
                raise TemplateRenderError("span marker closed without an opening marker")
            pieces.append(tail)
            break
        head = marked[pos:i]
        if SPAN_CLOSE in head:
            raise TemplateRenderError("span marker closed without an opening marker")
        j = marked.find(SPAN_CLOSE, i + 1)
        if j < 0:
            raise TemplateRenderError("span marker opened and never closed")
        body = marked[i + 1 : j]
        if SPAN_OPEN in body:
            raise TemplateRenderError("nested span markers")
        pieces.append(head)
        out_len += len(head)
        pieces.append(body)
        spans.append((out_len, out_len + len(body)))
        out_len += len(body)
        pos = j + 1
    if expected is not None and len(spans) != expected:
        raise TemplateRenderError(f"expected {expected} supervised spans, the template produced {len(spans)}")
    return RenderedConversation("".join(pieces), tuple(spans))


class ChatTemplate:
    """A compiled chat template (compile once, render many)."""

    def __init__(self, source: str, name: str = "<template>") -> None:
        self.source = source
        self.name = name
        self.sha256 = text_sha256_hex(source)
        self._compiled = _environment().from_string(source)

    def render_marked(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Rendered text with span markers still in place (add_generation_prompt=false)."""
        try:
            return self._compiled.render(messages=messages, tools=tools, add_generation_prompt=False)
        except TemplateRenderError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(f"{type(exc).__name__}: {exc}") from None
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            raise TemplateRenderError(f"{type(exc).__name__}: {exc}") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> RenderedConversation:
        """Render a normalised conversation; one supervised span per assistant message."""
        expected = sum(1 for m in messages if m.get("role") == "assistant")
        return extract_spans(self.render_marked(messages, tools), expected)


@lru_cache(maxsize=1)
def training_template() -> ChatTemplate:
    """Kiln's Qwen3.5 training template, compiled once per process."""
    return ChatTemplate(TRAINING_TEMPLATE_FILE.read_text(encoding="utf-8"), TRAINING_TEMPLATE_FILE.name)


@lru_cache(maxsize=1)
def official_chat_template() -> str:
    """The official Qwen3.5 think chat template text (the checkpoint artifact)."""
    return INFERENCE_TEMPLATE_FILE.read_text(encoding="utf-8")


def training_chat_template_sha256() -> str:
    """Hex SHA-256 of the marker-free effective training template (docs/tokenization.md#templates)."""
    return training_template().sha256


def chat_template_sha256(text: str | None = None) -> str:
    """Hex SHA-256 of a model's inference chat template (default: the official Qwen3.5 one)."""
    return text_sha256_hex(official_chat_template() if text is None else text)


class ChatTemplateSourceError(KilnError):
    """A model directory's chat-template source that cannot be read as one template string
    (`training_backend_unsupported`); `file` names the culprit file."""

    def __init__(self, detail: str, file: str) -> None:
        super().__init__(TRAINING_BACKEND_UNSUPPORTED, detail)
        self.file = file


_TEMPLATE_KINDS = {list: "a list of named templates", dict: "an object", bool: "a boolean", int: "a number"}


def load_model_chat_template(model_dir: str | Path) -> str | None:
    """A checkpoint's chat template: `chat_template.jinja`, else `tokenizer_config.json`'s field
    (None when neither holds one).

    Undecodable text, a tokenizer_config.json that is not a JSON object, or a `chat_template` that
    is not one string (a list of named templates, a number) raises `ChatTemplateSourceError` naming
    the file and field, instead of a UnicodeDecodeError / AttributeError, or "no chat template".
    """
    root = Path(model_dir)
    jinja_file = root / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ChatTemplateSourceError(
                f"chat_template.jinja in {root} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                jinja_file.name,
            ) from None
    config_file = root / TOKENIZER_CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        data = json.loads(config_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChatTemplateSourceError(
            f"tokenizer_config.json in {root} is not readable JSON: {exc}", config_file.name
        ) from None
    if not isinstance(data, dict):
        raise ChatTemplateSourceError(
            f"tokenizer_config.json in {root} must be a JSON object, got {type(data).__name__}",
            config_file.name,
        )
    template = data.get("chat_template")
    if template is not None and not isinstance(template, str):
        kind = _TEMPLATE_KINDS.get(type(template), "a number")
        raise ChatTemplateSourceError(
            f"tokenizer_config.json in {root}: field 'chat_template' is {kind}, not a template "
            "string; Kiln trains under one official Qwen3.5 template (ship it as chat_template.jinja)",
            config_file.name,
        )
    return template


@lru_cache(maxsize=1)
def official_nothink_chat_template() -> str:
    """The official Qwen3.5 "nothink" chat template text (2B and smaller checkpoints ship it)."""
    return NOTHINK_TEMPLATE_FILE.read_text(encoding="utf-8")


def official_chat_templates() -> dict[str, str]:
    """Flavour -> official Qwen3.5 chat template text, for every template Kiln can train under."""
    return {"think": official_chat_template(), "nothink": official_nothink_chat_template()}


def select_training_template(model_chat_template: str | None) -> ChatTemplate:
    """Validate the source-pinned model template and select the training variant
    (docs/tokenization.md#templates).

    Like TRL, selection is by exact string equality with an official Qwen3.5 template: the think
    template (4B and larger) or the nothink one (2B and smaller). Their training variants (TRL's
    `qwen3_5_think_training.jinja` / `qwen3_5_nothink_training.jinja`) differ only in the
    generation prompt, which SFT never renders (add_generation_prompt=false), so both select
    Kiln's one training template; qualification/sft_nothink_oracle.py proves the renders equal.
    Any other template has no verified training variant and is refused.
    """
    if model_chat_template is None:
        raise backend_unsupported("the model directory has no chat template (chat_template.jinja)")
    if model_chat_template not in official_chat_templates().values():
        known = ", ".join(f"{k} {text_sha256_hex(v)}" for k, v in official_chat_templates().items())
        raise backend_unsupported(
            "the model's chat template is not an official Qwen3.5 template "
            f"(sha256 {text_sha256_hex(model_chat_template)}; known: {known}); "
            "no verified SFT training variant exists for it"
        )
    return training_template()
