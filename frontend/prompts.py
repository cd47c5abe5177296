"""Prompts as token ids: the completions API's strings and id lists, and chat messages through the model's template.
A request's text is bounded as a whole (every prompt of a batch, every message and the template around them): past
what the context could hold it is refused before it is tokenized, and a prompt that tokenizes past the context ends
the tokenizing. The callers run these off the event loop."""
from frontend.errors import bad_request
from frontend.sampling import ModelInfo
from frontend.schemas import ChatCompletionRequest, CompletionRequest

MAX_PROMPTS = 64                              # prompts in one completions request


def completion_prompts(req: CompletionRequest, info: ModelInfo) -> tuple[list[list[int]], list[str]]:
    """(token ids, text) of each prompt; text is what `echo` repeats."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items or len(items) > MAX_PROMPTS:
        raise bad_request("prompt", f"must hold 1 to {MAX_PROMPTS} prompts, got {len(items)}")
    check_chars("prompt", sum(len(item) for item in items if isinstance(item, str)), info)
    ids, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids.append(info.tokenizer(item)["input_ids"])
            texts.append(item)
            check_tokens("prompt", len(ids[-1]), info)
        else:
            bad = [t for t in item if not 0 <= t < info.vocab_size]
            if bad:
                raise bad_request("prompt", f"token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})")
            ids.append(list(item))
            texts.append(info.tokenizer.decode(item) if req.echo else "")
        if not ids[-1]:
            raise bad_request("prompt", "is empty")
    return ids, texts


def check_chars(param: str, num_chars: int, info: ModelInfo) -> None:
    """Refuse a request's text that cannot fit one context before tokenizing it (a token holds at most
    max_token_chars)."""
    if num_chars > info.max_prompt_chars:
        raise bad_request(param, f"{num_chars} characters in this request cannot fit the model's context of "
                                 f"{info.max_context} tokens (a token holds at most {info.max_token_chars} characters)")


def check_tokens(param: str, num_tokens: int, info: ModelInfo) -> None:
    if num_tokens >= info.max_context:
        raise bad_request(param, f"{num_tokens} tokens leave no room in the model's context of {info.max_context}")


def chat_prompt(req: ChatCompletionRequest, info: ModelInfo) -> list[int]:
    """The messages rendered by the model's own chat template, as token ids."""
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    check_chars("messages", sum(len(m["content"]) for m in messages), info)
    try:
        text = info.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                  continue_final_message=req.continue_final_message, tokenize=False)
    except Exception as err:                    # a template may refuse an order of roles
        raise bad_request("messages", f"the model's chat template refused them: {err}") from None
    check_chars("messages", len(text), info)    # with the template's own text around each message
    ids = info.tokenizer(text, add_special_tokens=False)["input_ids"]
    check_tokens("messages", len(ids), info)
    return ids
