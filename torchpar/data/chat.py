"""Chat data for supervised fine-tuning: conversations rendered by a chat template, the loss on the
assistant's turns only, packed whole into training windows.

A conversation is a JSONL record's ``messages``: ``[{"role": "user", "content": "..."}, ...]``,
the form most fine-tuning sets use. A :class:`ChatTemplate` turns it into token ids; each token
that is no loss target carries ``loss.NO_LOSS`` (BOS, every turn's header, every turn but the
assistant's), so the mask travels with the tokens. :class:`Llama3Template` is Llama 3's:

    BOS, then per message: <|start_header_id|> role <|end_header_id|> "\\n\\n" content <|eot_id|>

where an assistant's content and its <|eot_id|> are targets (the model learns to end its turn);
:class:`Qwen3Template` is Qwen's ChatML form. A fork adds a template by subclassing
:class:`ChatTemplate` (its ``turn``: a message's header, content and what follows) and naming it
in :data:`TEMPLATES`.

Packing (:func:`pack`): conversations in source order fill bins of one training window
(``training.seq_len + 1`` tokens); one that does not fit a bin's rest starts the next bin, and the
rest is padding (EOS, no target). Each bin is then one document of exactly one window, so no window
cuts a conversation, and with ``data.document_masking`` none attends to another (each starts with
its BOS). A conversation longer than a window is truncated to it or left out
(``data.chat_too_long``), counted either way.
"""

from __future__ import annotations

import numpy as np

from torchpar.errors import ConfigError
from torchpar.loss import NO_LOSS
from torchpar.tokenizer import TokenizerError


class ChatTemplate:
    """How a conversation becomes token ids. ``roles``: the roles it renders; ``specials``: the
    special tokens it uses, which the tokenizer must have."""

    name = ""
    roles: tuple[str, ...] = ()
    specials: tuple[str, ...] = ()

    def turn(self, message: dict, tokenizer) -> tuple[list[int], list[int], list[int]]:
        """One message's ids: (its header, its content with its end token — the targets when the
        assistant speaks —, what follows)."""
        raise NotImplementedError

    def render(self, messages: list[dict], tokenizer) -> list[int]:
        """Token ids of the conversation (BOS, then each turn), NO_LOSS set on every token that is
        no target."""
        out = [tokenizer.bos_id | NO_LOSS]
        for m in messages:
            head, body, tail = self.turn(m, tokenizer)
            out += [t | NO_LOSS for t in head]
            out += body if m["role"] == "assistant" else [t | NO_LOSS for t in body]
            out += [t | NO_LOSS for t in tail]
        return out

    def vocab_size(self, tokenizer) -> int:
        """The vocabulary a model needs for it with ``tokenizer``: one line (ConfigError) for a
        tokenizer without its special tokens."""
        try:
            return max(tokenizer.special(s) for s in self.specials) + 1
        except TokenizerError as e:
            raise ConfigError(f"data.chat_template = {self.name!r}: {e}; use the tokenizer of the model the "
                              "template belongs to (model.tokenizer_path), or another template") from None


class Llama3Template(ChatTemplate):
    name = "llama3"
    roles = ("system", "user", "assistant", "ipython")
    specials = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

    def turn(self, message: dict, tokenizer) -> tuple[list[int], list[int], list[int]]:
        start, end, eot = (tokenizer.special(s) for s in self.specials)
        head = [start, *tokenizer.encode(message["role"], bos=False, eos=False), end,
                *tokenizer.encode("\n\n", bos=False, eos=False)]
        return head, [*tokenizer.encode(message["content"].strip(), bos=False, eos=False), eot], []


class Qwen3Template(ChatTemplate):
    """Qwen's ChatML form: per message <|im_start|> role "\n" content <|im_end|> "\n", the content as
    given; an assistant's content and its <|im_end|> are targets. Conversations without reasoning
    blocks (Qwen3's template renders those as they are too). Qwen has no BOS: the tokenizer's
    (<|endoftext|>) starts each conversation, no target, so documents stay apart."""

    name = "qwen3"
    roles = ("system", "user", "assistant", "tool")
    specials = ("<|im_start|>", "<|im_end|>")

    def turn(self, message: dict, tokenizer) -> tuple[list[int], list[int], list[int]]:
        start, end = (tokenizer.special(s) for s in self.specials)
        head = [start, *tokenizer.encode(message["role"] + "\n", bos=False, eos=False)]
        body = [*tokenizer.encode(message["content"], bos=False, eos=False), end]
        return head, body, tokenizer.encode("\n", bos=False, eos=False)


TEMPLATES: dict[str, ChatTemplate] = {t.name: t for t in (Llama3Template(), Qwen3Template())}


def messages_of(messages, field: str, template: ChatTemplate, where: str) -> list[dict] | None:
    """A JSONL record's conversation (its ``field``), checked: one line naming ``where``
    (file:line) for one that is malformed or holds a role ``template`` lacks; None for one with no
    assistant turn (nothing to learn from: the caller counts it)."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: '{field}' must be a non-empty list of {{\"role\": ..., \"content\": "
                          f"...}}, got {str(messages)[:40]}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: message {i} is not {{\"role\": \"...\", \"content\": \"...\"}} with "
                              f"strings ({str(m)[:60]})")
        if m["role"] not in template.roles:
            raise ConfigError(f"{where}: message {i}'s role {m['role']!r} is not one the {template.name} "
                              f"template renders ({', '.join(template.roles)}); fix the record or choose "
                              "another data.chat_template")
    return messages if any(m["role"] == "assistant" for m in messages) else None


def pack(conversations: list[list[int]], window: int, too_long: str, pad: int) -> tuple[np.ndarray, dict]:
    """Conversations' ids in bins of ``window`` tokens [bins, window] (uint32, ``pad`` after each
    bin's last conversation), in order, none split; one longer than a window is cut to it
    (``too_long`` = 'truncate') or left out ('drop'). Returns the bins and the counts of each."""
    bins, current, counts = [], [], {"truncated": 0, "dropped": 0}
    for ids in conversations:
        if len(ids) > window:
            if too_long == "drop":
                counts["dropped"] += 1
                continue
            ids, counts["truncated"] = ids[:window], counts["truncated"] + 1
        if len(current) + len(ids) > window:
            bins.append(current + [pad] * (window - len(current)))
            current = []
        current += ids
    if current:
        bins.append(current + [pad] * (window - len(current)))
    return np.asarray(bins, dtype=np.uint32).reshape(-1, window), counts
