"""`/tokenize` and `/detokenize` in vLLM's formats: a prompt's or a conversation's token ids as
the completion endpoints would feed them to the model (so `count` is what `usage.prompt_tokens`
will say), and token ids back to text."""

from __future__ import annotations

from eagleserve.server.chat import chat_text
from eagleserve.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from eagleserve.server.serving import ApiError, Serving
from eagleserve.server.tool_calls import tool_setup


def tokenize(serving: Serving, body: TokenizeRequest) -> TokenizeResponse | ApiError:
    if (body.prompt is None) == (body.messages is None):
        return ApiError(400, "send either prompt or messages", "prompt")
    if body.messages is not None:
        chat = ChatCompletionRequest(
            messages=body.messages, tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )  # fmt: skip
        tools = tool_setup(chat, serving.tool_format)
        if isinstance(tools, ApiError):
            return tools
        text = chat_text(serving.tokenizer, chat, tools, serving.tool_format)
        if isinstance(text, ApiError):
            return text
        special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        special = body.add_special_tokens is not False
    ids = serving.encode(text, special)
    if isinstance(ids, ApiError):
        return ids
    tok = serving.tokenizer
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    ctx = serving.client.max_context_len
    return TokenizeResponse(count=len(ids), max_model_len=ctx, tokens=ids, token_strs=strs)


def detokenize(serving: Serving, body: DetokenizeRequest) -> DetokenizeResponse | ApiError:
    tok = serving.tokenizer
    if tok is None:
        return ApiError(400, "this model has no tokenizer", "tokens")
    vocab = serving.client.ready.vocab_size if serving.client.ready else 0
    bound = min(vocab, len(tok)) if vocab else len(tok)
    if any(t < 0 or t >= bound for t in body.tokens):
        return ApiError(400, f"token ids must be in [0, {bound})", "tokens")
    return DetokenizeResponse(prompt=tok.decode(body.tokens))
