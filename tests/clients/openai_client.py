#!/usr/bin/env python3
"""A client of the cluster built on the unmodified `openai` package (scripts/python-env.sh).

Usage: openai_client.py BASE_URL < specs.json > results.json

BASE_URL is the API root (http://127.0.0.1:PORT/v1). stdin is a JSON list of request specs:

    {"api": "chat" | "completions" | "responses",
     "stream": bool, "n": int, "max_tokens": int, "temperature": float, "seed": int | null,
     "messages": [...] (chat), "prompt": str | [int] | a list of either (completions),
     "input": str (responses),
     "sampling": {...},     # optional SDK arguments, e.g. {"presence_penalty": 0.5}
     "extra_body": {...},   # optional, e.g. {"ignore_eos": true, "return_token_ids": true}
     "continue": bool,      # optional: the next turn of the previous spec's conversation
     "stored": bool,        # optional (responses): read the answer back as the server stored it
     "delete": bool}        # optional (responses, with stored): then delete it

stdout is a JSON list with one result per spec, in order:

    {"texts": [str per choice], "token_ids": [[int] per choice] | null, "finish_reasons": [...],
     "usage": {... as the SDK parsed it}, "prompt_tokens": int, "cached_tokens": int | null,
     "kv_pulled_tokens": int | null, "response_id": str | null,
     "tool_calls": [[{"name": str, "arguments": str}] per choice] (chat: `tool_calls`;
                   responses: the `function_call` output items),
     "logprobs": [legacy logprobs object | null per choice] (completions; streamed: the
                 chunks' lists joined),
     "prompt_logprobs": vLLM's field (completions: one per choice; chat: the response's)}

A responses spec with `"stored": true` adds `"stored"` to its result: `responses.retrieve` of
its id (which must give back the same id, `output_text` and `status`) as
`{"previous_response_id", "store"}`, and `responses.input_items.list(order="asc")` as
`"input_texts"` (each item's first text part). With `"delete": true` it then calls
`responses.delete` and checks that a second `retrieve` raises `NotFoundError` (`"deleted": true`).

A spec with `"continue": true` goes on from the spec before it, as an application keeps a
conversation: on chat, its messages are sent after the previous spec's messages and the previous
answer (an `assistant` message: the client resends the history); on responses, with
`previous_response_id` set to the previous answer's id (the server keeps the history).

`kv_pulled_tokens` and the choices' `token_ids` (vLLM's `return_token_ids` extension) are not
fields the SDK knows: they are read from the parsed objects' `model_extra` (pydantic keeps
unknown fields), the way an application would. `token_ids` is null for the Responses API and
when the server sent none. Streams are
assembled from the deltas; their usage comes from the final chunk (`stream_options=
{"include_usage": true}`) or, for the Responses API, from the `response.completed` event, whose
`output_text` must equal the assembled deltas. Any API error makes the script fail (exit 1) with
the error on stderr: the SDK's retries are off, so nothing is hidden.
"""

import json
import os
import sys

import openai


def details_extra(details, field):
    """A field of a usage-details object the SDK does not declare (pydantic `model_extra`)."""
    if details is None:
        return None
    extra = getattr(details, "model_extra", None) or {}
    if field in extra:
        return extra[field]
    return details.model_dump().get(field)


def token_ids(choice):
    """The generated token ids of a choice or chunk choice (vLLM's `return_token_ids`)."""
    extra = getattr(choice, "model_extra", None) or {}
    return extra.get("token_ids")


def extra(obj, field):
    """A field the SDK does not declare, from the parsed object's `model_extra`."""
    return (getattr(obj, "model_extra", None) or {}).get(field)


def join_logprobs(acc, logprobs):
    """A streamed choice's legacy logprobs: each chunk's lists appended to the ones before."""
    if logprobs is None:
        return acc
    got = logprobs.model_dump()
    if acc is None:
        return got
    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        acc[k] = (acc.get(k) or []) + (got.get(k) or [])
    return acc


def collect_ids(ids, choice):
    got = token_ids(choice)
    if got is not None:
        ids[choice.index] = (ids[choice.index] or []) + list(got)


def usage_fields(usage, prompt_attr, details_attr):
    if usage is None:
        return {"usage": None, "prompt_tokens": None, "cached_tokens": None, "kv_pulled_tokens": None}
    details = getattr(usage, details_attr, None)
    return {
        "usage": usage.model_dump(),
        "prompt_tokens": getattr(usage, prompt_attr),
        "cached_tokens": getattr(details, "cached_tokens", None) if details is not None else None,
        "kv_pulled_tokens": details_extra(details, "kv_pulled_tokens"),
    }


def sampling(spec):
    kwargs = {"model": spec.get("model", "tiny"), "temperature": spec.get("temperature", 0)}
    # SDK arguments beyond the common ones, e.g. {"presence_penalty": 0.5, "logit_bias": {...}}.
    kwargs.update(spec.get("sampling", {}))
    if spec.get("extra_body"):
        kwargs["extra_body"] = spec["extra_body"]
    return kwargs


def chat(client, spec):
    kwargs = sampling(spec)
    kwargs.update(messages=spec["messages"], n=spec.get("n", 1), max_tokens=spec["max_tokens"])
    if spec.get("seed") is not None:
        kwargs["seed"] = spec["seed"]
    n = spec.get("n", 1)
    if not spec.get("stream"):
        r = client.chat.completions.create(**kwargs)
        choices = sorted(r.choices, key=lambda c: c.index)
        out = {
            "texts": [c.message.content or "" for c in choices],
            "token_ids": [token_ids(c) for c in choices],
            "finish_reasons": [c.finish_reason for c in choices],
            "tool_calls": [
                [{"name": t.function.name, "arguments": t.function.arguments} for t in (c.message.tool_calls or [])]
                for c in choices
            ],
            "prompt_logprobs": extra(r, "prompt_logprobs"),
        }
        out.update(usage_fields(r.usage, "prompt_tokens", "prompt_tokens_details"))
        return out
    texts, ids, finish, usage = [""] * n, [None] * n, [None] * n, None
    calls = [[] for _ in range(n)]
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            # Tool calls arrive as deltas: a call's index, id and name first, then pieces of
            # its arguments.
            for t in c.delta.tool_calls or []:
                while len(calls[c.index]) <= t.index:
                    calls[c.index].append({"name": None, "arguments": ""})
                if t.function is not None:
                    if t.function.name:
                        calls[c.index][t.index]["name"] = t.function.name
                    calls[c.index][t.index]["arguments"] += t.function.arguments or ""
            collect_ids(ids, c)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    out = {"texts": texts, "token_ids": ids, "finish_reasons": finish, "tool_calls": calls}
    out.update(usage_fields(usage, "prompt_tokens", "prompt_tokens_details"))
    return out


def completions(client, spec):
    kwargs = sampling(spec)
    kwargs.update(prompt=spec["prompt"], n=spec.get("n", 1), max_tokens=spec["max_tokens"])
    if spec.get("seed") is not None:
        kwargs["seed"] = spec["seed"]
    n = spec.get("n", 1)
    if not spec.get("stream"):
        r = client.completions.create(**kwargs)
        choices = sorted(r.choices, key=lambda c: c.index)
        out = {
            "texts": [c.text for c in choices],
            "token_ids": [token_ids(c) for c in choices],
            "finish_reasons": [c.finish_reason for c in choices],
            "logprobs": [c.logprobs.model_dump() if c.logprobs else None for c in choices],
            "prompt_logprobs": [extra(c, "prompt_logprobs") for c in choices],
        }
        out.update(usage_fields(r.usage, "prompt_tokens", "prompt_tokens_details"))
        return out
    # A list of prompts (a batch) has n choices per prompt.
    prompt = spec["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        n *= len(prompt)
    texts, ids, finish, usage = [""] * n, [None] * n, [None] * n, None
    logprobs = [None] * n
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text or ""
            collect_ids(ids, c)
            logprobs[c.index] = join_logprobs(logprobs[c.index], c.logprobs)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    out = {"texts": texts, "token_ids": ids, "finish_reasons": finish, "logprobs": logprobs}
    out.update(usage_fields(usage, "prompt_tokens", "prompt_tokens_details"))
    return out


def function_calls(output):
    """A response's `function_call` output items, as {"name", "arguments"}."""
    return [{"name": i.name, "arguments": i.arguments} for i in output if i.type == "function_call"]


def responses(client, spec):
    kwargs = sampling(spec)
    kwargs.update(input=spec["input"], max_output_tokens=spec["max_tokens"])
    if spec.get("previous_response_id"):
        kwargs["previous_response_id"] = spec["previous_response_id"]
    if spec.get("n", 1) != 1:
        raise ValueError("the Responses API has no n")
    if not spec.get("stream"):
        r = client.responses.create(**kwargs)
        out = {"texts": [r.output_text], "token_ids": None, "finish_reasons": [r.status], "response_id": r.id,
               "tool_calls": [function_calls(r.output)]}
        out.update(usage_fields(r.usage, "input_tokens", "input_tokens_details"))
        return out
    text, final = "", None
    # Calls as the events build them: an item added (its name), argument deltas, done.
    calls, arguments = {}, {}
    for event in client.responses.create(stream=True, **kwargs):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.output_item.added" and event.item.type == "function_call":
            calls[event.item.id] = event.item.name
            arguments[event.item.id] = ""
        elif event.type == "response.function_call_arguments.delta":
            arguments[event.item_id] += event.delta
        elif event.type == "response.function_call_arguments.done":
            if event.arguments != arguments[event.item_id]:
                raise RuntimeError(f"argument deltas {arguments[event.item_id]!r} differ from .done's {event.arguments!r}")
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
        elif event.type in ("response.failed", "error"):
            raise RuntimeError(f"stream error event: {event.model_dump_json()}")
    if final is None:
        raise RuntimeError("the stream ended without response.completed")
    if final.output_text != text:
        raise RuntimeError(f"deltas {text!r} differ from the final output_text {final.output_text!r}")
    streamed = [{"name": calls[k], "arguments": arguments[k]} for k in calls]
    if streamed != function_calls(final.output):
        raise RuntimeError(f"streamed calls {streamed!r} differ from the final output's {function_calls(final.output)!r}")
    out = {"texts": [text], "token_ids": None, "finish_reasons": [final.status], "response_id": final.id,
           "tool_calls": [streamed]}
    out.update(usage_fields(final.usage, "input_tokens", "input_tokens_details"))
    return out


def stored(client, spec, out):
    """Reads a responses answer back from the server's store (the spec's `stored`/`delete`)."""
    rid, text, status = out["response_id"], out["texts"][0], out["finish_reasons"][0]
    r = client.responses.retrieve(rid)
    if (r.id, r.output_text, r.status) != (rid, text, status):
        raise RuntimeError(f"retrieved {(r.id, r.output_text, r.status)!r}, answered {(rid, text, status)!r}")
    items = client.responses.input_items.list(rid, order="asc")
    texts = [i.content[0].text for i in items.data if getattr(i, "content", None)]
    out["stored"] = {"previous_response_id": r.previous_response_id, "store": r.store, "input_texts": texts}
    if spec.get("delete"):
        client.responses.delete(rid)
        try:
            client.responses.retrieve(rid)
        except openai.NotFoundError:
            out["deleted"] = True
        else:
            raise RuntimeError(f"{rid} still retrieved after responses.delete")
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    api_key = os.environ.get("PD_TEST_API_KEY") or "sk-cluster-test"
    client = openai.OpenAI(base_url=sys.argv[1], api_key=api_key, max_retries=0, timeout=120)
    specs = json.load(sys.stdin)
    calls = {"chat": chat, "completions": completions, "responses": responses}
    results = []
    sent_messages = None
    for i, spec in enumerate(specs):
        if spec.get("continue"):
            prev = results[-1]
            if spec["api"] == "chat":
                history = sent_messages + [{"role": "assistant", "content": prev["texts"][0]}]
                spec = dict(spec, messages=history + spec["messages"])
            elif spec["api"] == "responses":
                spec = dict(spec, previous_response_id=prev["response_id"])
        if spec["api"] == "chat":
            sent_messages = spec["messages"]
        try:
            out = calls[spec["api"]](client, spec)
            if spec.get("stored"):
                out = stored(client, spec, out)
            results.append(out)
        except Exception as e:  # noqa: BLE001 - reported with the spec, then fail
            print(f"spec {i} ({json.dumps(spec)}) failed: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
