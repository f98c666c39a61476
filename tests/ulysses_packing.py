"""Run by tests/test_packed_attention.py under torchrun, 2 CPU processes over gloo: DeepSpeed's own Ulysses chain
(`UlyssesSPAttentionHF.register_with_transformers`, `UlyssesSPDataLoaderAdapter`, the sp-sharded loss summed over
the SP group as TRL does) on one packed row of two documents, against the same documents unpacked.

Prints one JSON line on rank 0: the token-mean loss of
- `unpacked`: each document alone, plain SDPA, no SP (the reference);
- `packed_no_sp`: the packed row, plain SDPA, no SP (transformers builds a block mask from position_ids);
- `packed_mixed`: the packed row, plain SDPA (whatever ATTENTION is), no SP, with an all-ones attention mask
  (transformers then looks for no documents: causal over the whole row, what every document attending to the ones
  before it costs; a flash path would still find them in position_ids);
- `ulysses_sdpa`: the packed row through Ulysses SP2 on SDPA, the ALST recipe's chain on CPU;
- `ulysses_varlen`: the same on an attention that keeps the documents apart from position_ids, as flash attention's
  varlen path does on GPUs (SDPA with a block-diagonal causal mask, registered through transformers'
  AttentionInterface).
`python -m torch.distributed.run --nproc_per_node 1 tests/ulysses_packing.py MODEL ATTENTION` (make gpu-check, on a
CUDA GPU in bf16) gives the first three alone for ATTENTION (flash_attention_2: the varlen kernel that
keeps packed documents apart on GPUs, the one Ulysses relies on).
"""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

VARLEN = "orch_varlen_sdpa"
SP = 2


def varlen_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Causal attention within each document of a packed row; a document starts where position_ids return to 0."""
    positions = kwargs["position_ids"]  # [batch, the whole sequence]: Ulysses gathered them
    document = (positions == 0).cumsum(-1)
    length = positions.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = (document[:, :, None] == document[:, None, :]) & causal
    return sdpa_attention_forward(module, query, key, value, mask[:, None], is_causal=False,
                                  **{k: v for k, v in kwargs.items() if k != "is_causal"})  # fmt: skip


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def token_losses(model, input_ids, position_ids, shift_labels, mixed=False):
    input_ids, position_ids, shift_labels = (t.to(DEVICE) for t in (input_ids, position_ids, shift_labels))
    mask = torch.ones_like(input_ids) if mixed else None
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                   use_cache=False).logits.float()  # use_cache=False as TRL calls it  # fmt: skip
    losses = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100, reduction="sum")
    return losses, (shift_labels != -100).sum()


def unpacked(model, documents) -> float:
    total, count = 0.0, 0
    for doc in documents:
        ids = torch.tensor([doc])
        shift = F.pad(ids, (0, 1), value=-100)[:, 1:]
        loss, n = token_losses(model, ids, torch.arange(len(doc))[None], shift)
        total, count = total + loss.item(), count + int(n)
    return total / count


def packed_batch(documents) -> dict:
    ids = [t for doc in documents for t in doc]
    positions = [p for doc in documents for p in range(len(doc))]
    labels = list(ids)
    start = 0
    for doc in documents[:-1]:  # the first token of the next document is no target of the previous one's last
        start += len(doc)
        labels[start] = -100
    return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions]),
            "labels": torch.tensor([labels])}  # fmt: skip


def ulysses(model_dir: str, attention: str, batch: dict) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, attn_implementation=attention).to(DEVICE)
    UlyssesSPAttentionHF.register_with_transformers(model, attention, SP, micro_batch_size=1)
    group = mpu.get_sequence_parallel_group()
    loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader([batch], batch_size=None), dist.get_rank(group),
                                        group, SP, torch.device("cpu"))  # fmt: skip
    shard = next(loader)  # this rank's slice of rank 0's row, with the labels shifted over the whole row
    loss, count = token_losses(model, shard["input_ids"], shard["position_ids"], shard["shift_labels"])
    both = torch.stack([loss.detach(), count.float()])
    dist.all_reduce(both, group=group)  # TRL's SP loss: the token-weighted sum over the SP group
    mpu._release_sequence_parallel_groups()
    return (both[0] / both[1]).item()


def main(model_dir: str, attention: str = "sdpa") -> None:
    if not torch.cuda.is_available():  # as the training entry does on CPU: no C++ build of the shared-memory op
        from orchestrator.train import cpu_deepspeed

        cpu_deepspeed.skip_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm, which its SP groups are made with
    torch.manual_seed(0)
    AttentionInterface.register(VARLEN, varlen_sdpa)
    AttentionMaskInterface.register(VARLEN, sdpa_mask)
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(5, 200, (n,), generator=generator).tolist() for n in (20, 4, 4, 4)]  # 32 tokens
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, attn_implementation=attention).to(DEVICE)
    batch = packed_batch(documents)
    shift = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    loss, count = token_losses(plain, batch["input_ids"], batch["position_ids"], shift)
    result = {"attention": attention, "unpacked": unpacked(plain, documents), "packed_no_sp": (loss / count).item()}
    # what mixing costs: SDPA on an all-ones mask (a flash path would still find the documents in position_ids)
    sdpa = plain
    if attention != "sdpa":
        sdpa = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, attn_implementation="sdpa").to(DEVICE)
    loss, count = token_losses(sdpa, batch["input_ids"], batch["position_ids"], shift, mixed=True)
    result["packed_mixed"] = (loss / count).item()
    if dist.get_world_size() == SP:
        result["ulysses_sdpa"] = ulysses(model_dir, "sdpa", batch)  # replaces transformers' "sdpa" by its wrapper
        result["ulysses_varlen"] = ulysses(model_dir, VARLEN, batch)
    if dist.get_rank() == 0:
        print("LOSSES " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
