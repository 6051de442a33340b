"""Exact microbatching of a fairseq translation batch (the plugin's ``--microbatches k``): the batch's own sentences
in sub-batches of at most max-tokens/k tokens each, padding included, accumulated into the same update. Without
fairseq imports, so the accountant and the tests share it with the plugin's task."""

from __future__ import annotations

from typing import Any

import torch


def part_sizes(sizes: list[int], limit: int, k: int) -> list[list[int]]:
    """Exact microbatching's sub-batches of one batch, as lists of its sentence positions in order: each of at most
    ``limit`` tokens counted as fairseq counts a batch (sentences x the longest one's tokens, padding included),
    and at least ``min(k, sentences)`` of them, so that a short batch still runs one sentence at a time."""
    if sizes and max(sizes) > limit:
        raise ValueError(f"a sentence pair of {max(sizes)} tokens is longer than a sub-batch's {limit} tokens "
                         "(--max-tokens / --microbatches): raise --max-tokens or lower --microbatches")
    parts: list[list[int]] = []
    longest = 0
    for i, n in enumerate(sizes):
        if parts and (len(parts[-1]) + 1) * max(longest, n) <= limit:
            parts[-1].append(i)
            longest = max(longest, n)
        else:
            parts.append([i])
            longest = n
    while len(parts) < min(k, len(sizes)):
        j = max(range(len(parts)), key=lambda j: len(parts[j]))  # the largest part, halved
        parts[j:j + 1] = [parts[j][:len(parts[j]) // 2], parts[j][len(parts[j]) // 2:]]
    return parts


def split_batch(sample: dict[str, Any], limit: int, k: int, pad: int, left_pad_source: bool = True,
                left_pad_target: bool = False) -> list[dict[str, Any]]:
    """A batch of fairseq's ``LanguagePairDataset`` as ``part_sizes``' sub-batches, each trimmed to its own longest
    source and target (the padding a smaller batch of those sentences has). Hand-written: fairseq's only
    accumulation is ``--update-freq``, which draws other batches from the corpus rather than splitting these."""
    net = sample["net_input"]
    src_len = net["src_lengths"].tolist()
    tgt_len = sample["target"].ne(pad).sum(1).tolist()
    parts = part_sizes([max(a, b) for a, b in zip(src_len, tgt_len)], limit, k)

    def cut(t: torch.Tensor, index: torch.Tensor, width: int, left: bool) -> torch.Tensor:
        t = t.index_select(0, index)
        return (t[:, t.size(1) - width:] if left else t[:, :width]).contiguous()

    out = []
    for part in parts:
        index = torch.tensor(part, device=sample["target"].device)
        ws, wt = max(src_len[i] for i in part), max(tgt_len[i] for i in part)
        out.append({**{k_: v for k_, v in sample.items() if k_ not in ("net_input", "target", "id", "nsentences", "ntokens")},
                    "id": sample["id"].index_select(0, index), "nsentences": len(part),
                    "ntokens": sum(tgt_len[i] for i in part),
                    "net_input": {**net, "src_tokens": cut(net["src_tokens"], index, ws, left_pad_source),
                                  "src_lengths": net["src_lengths"].index_select(0, index),
                                  "prev_output_tokens": cut(net["prev_output_tokens"], index, wt, left_pad_target)},
                    "target": cut(sample["target"], index, wt, left_pad_target)})
    return out
