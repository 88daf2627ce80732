"""Chat records through the model's chat template: the rendered text and the spans that carry loss.

Training (`jobs.data.tokenizing`) labels the characters `chat_spans` returns; `rayft eval` feeds
the model `chat_prompt_ids`, the same rendering with the generation prompt, so evaluation
prompts are exactly what the training labels followed. A conversational preference pair
(`jobs.data.pairs`) becomes the texts of `chat_pair_texts`, by the same rule. A template that
cannot render a conversation, or renders it in a way whose turns cannot be told apart, is a
SpecError naming the model.
"""

from __future__ import annotations

from typing import NoReturn

from jobs.errors import SpecError
from jobs.spec import one_line


def _model_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or "the model"


def _render(tokenizer, messages: list[dict], generation_prompt: bool, model_name: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise SpecError(
            f'model.name: {model_name} has no chat template; chat records ("messages", conversational pairs) need one'
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # a Jinja error raised by the template itself (e.g. "roles must alternate")
        raise SpecError(
            f"model.name: the chat template of {model_name} refused a conversation ({one_line(str(e))[:160]})"
        ) from None


def chat_spans(
    tokenizer,
    messages: list[dict],
    train_on: str = "assistant",
    model_name: str | None = None,
    max_chars: int | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans that carry loss.

    The span of assistant turn i is what the template adds between rendering `messages[:i]` with
    the generation prompt and rendering `messages[:i+1]`: the turn's content and the template's
    end-of-turn text, nothing of the prompt. That needs a prefix-stable template (each rendering a
    prefix of the next); one that is not is refused with a SpecError naming the model.

    With `max_chars` (the tokenizer reads only that many characters of the text: `char_bound`),
    the turns are rendered in order and the renders stop at the first turn whose rendering reaches
    `max_chars` characters; that rendering stands for the whole conversation, of which it is a
    prefix. So the renders cost what the first `max_chars` characters hold, never the square of
    a long conversation, and the first `max_chars` characters and every span starting in them are
    those of rendering everything (a record that fits renders as before)."""
    name = model_name or _model_name(tokenizer)
    # An assistant message that opens the conversation answers nothing: it is context, not a turn
    # (templates cannot render the empty conversation before it).
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    if train_on == "last_assistant":
        turns = turns[-1:]
    spans: list[tuple[int, int]] = []
    # The longest rendering so far, and its turn: every rendering must be a prefix of the whole, so
    # of any two one is a prefix of the other; checked as they come, without keeping them all.
    longest, longest_turn = "", 0
    full = None
    for i in turns:
        before = _render(tokenizer, messages[:i], True, name)
        after = _render(tokenizer, messages[: i + 1], False, name)
        if not after.startswith(before) or not (after.startswith(longest) or longest.startswith(after)):
            _not_prefix_stable(name, i)
        if len(after) > len(longest):
            longest, longest_turn = after, i
        spans.append((len(before), len(after)))
        if max_chars is not None and len(after) >= max_chars:
            full = after  # every later turn starts past what the tokenizer reads
            break
    if full is None:
        full = _render(tokenizer, messages, False, name)
    if not full.startswith(longest):
        _not_prefix_stable(name, longest_turn)
    return full, spans


def _not_prefix_stable(name: str, i: int) -> NoReturn:
    raise SpecError(
        f"model.name: the chat template of {name} is not prefix-stable (rendering the first "
        f"{i + 1} messages is not a prefix of the whole conversation), so the tokens of an "
        "assistant turn cannot be told apart; use prompt/completion records instead"
    )


def chat_prompt_ids(tokenizer, messages: list[dict], model_name: str | None = None) -> list[int]:
    """Token ids of `messages` rendered with the generation prompt: what `rayft eval` feeds the
    model, the same text the training labels of the next assistant turn follow."""
    text = _render(tokenizer, messages, True, model_name or _model_name(tokenizer))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_pair_texts(
    tokenizer, prompt: list[dict], chosen: list[dict], rejected: list[dict], model_name: str | None = None
) -> tuple[str, str, str]:
    """(prompt text, chosen text, rejected text) of a conversational pair, as TRL renders them:
    the prompt is `prompt` rendered with the generation prompt; a response is what rendering
    `prompt + response` adds after it (its content and the template's end-of-turn text). That
    needs the prompt's rendering to be a prefix of both; a template for which it is not is
    refused with a SpecError naming the model."""
    name = model_name or _model_name(tokenizer)
    head = _render(tokenizer, prompt, True, name)
    responses = []
    for response in (chosen, rejected):
        full = _render(tokenizer, prompt + response, False, name)
        if not full.startswith(head):
            raise SpecError(
                f"model.name: the chat template of {name} is not prefix-stable for the prompt (the prompt "
                "rendered with the generation prompt is not a prefix of prompt + response), so the "
                "response tokens cannot be told apart; use string pairs instead"
            )
        responses.append(full[len(head) :])
    return head, responses[0], responses[1]
