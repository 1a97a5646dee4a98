"""The check's phases with their estimates, and its formulas and verdicts
(pure: no process started, nothing read)."""

import re
from typing import Optional

PHASES = (
    ("records", 15, "13.7 s measured on an H200 host (7073d0d)", 10),
    ("equivalence", 150, "3 BERT-base processes compiling at once: 53 s to "
     "the first interval (H200, 7073d0d), 40 steps", 100),
    ("speed", 120, "a BERT-base run alone: 151.8 s for 120 steps at batch "
     "256 with a profile (H200, 7073d0d)", 50),
    ("all-reduce", 45, "estimated: start-up 20 s, 3 sizes x 6 all-reduces",
     40),
    ("resume", 100, "the equivalence runs' start and compile, alone", 50),
    ("speed-1", 100, "as speed, one process", 40),
)
ESTIMATES = {name: (gpu, tiny) for name, gpu, _, tiny in PHASES}

# Dense bf16 peak TFLOP/s of one GPU, by the name nvidia-smi gives it.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
               "B200": 2250.0}

BERT_BASE = {"vocab_size": 30522, "hidden_size": 768,
             "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "hidden_act": "gelu",
             "hidden_dropout_prob": 0.1,
             "attention_probs_dropout_prob": 0.1,
             "max_position_embeddings": 512, "type_vocab_size": 2,
             "initializer_range": 0.02}
TINY = dict(BERT_BASE, hidden_size=128, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=512)

# nvidia-smi topo -m's words for the link between two GPUs.
LINKS = {"NV": "NVLink", "PIX": "PCIe (one switch)",
         "PXB": "PCIe (several switches)", "PHB": "PCIe through the CPU",
         "NODE": "PCIe across a NUMA node", "SYS": "PCIe and the CPUs' link"}


def flops_per_sequence(config: dict, seq: int = 128) -> float:
    """Training FLOPs of one sequence: 6 x the non-embedding parameters'
    multiply-adds per token x `seq` tokens, plus the attention's score
    and context matmuls (forward and backward)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    inner = config["intermediate_size"]
    per_layer = 4 * hidden * hidden + 2 * hidden * inner
    dense = 6 * layers * per_layer * seq
    attention = 3 * 2 * 2 * layers * seq * seq * hidden
    return dense + attention


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> float:
    """An all-reduce's bus bandwidth in bytes/s, as nccl-tests define it:
    the algorithm bandwidth (bytes / seconds) x 2(n-1)/n, what each link
    carries in a ring."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks


def link_between(topo: str, a: int = 0, b: int = 1) -> Optional[str]:
    """The link between GPU `a` and GPU `b` in `nvidia-smi topo -m`'s
    matrix ("NV18: NVLink", "PIX: PCIe (one switch)"), or None."""
    rows = [line.split() for line in topo.splitlines() if line.strip()]
    if not rows:
        return None
    header = rows[0]
    for row in rows[1:]:
        if row and row[0] == f"GPU{a}" and f"GPU{b}" in header:
            # The header has no first column: its cells shift by one.
            word = row[header.index(f"GPU{b}") + 1]
            kind = re.match(r"[A-Z]+", word)
            name = LINKS.get(kind.group(0) if kind else "", "")
            return f"{word}: {name}" if name else word
    return None


def sigterm_row(delivered: bool, first_exit, seconds_to_complete,
                seconds_to_exit, rerun_exit=None, comparison=None) -> dict:
    """The SIGTERM check's row: the rerun's weights count only when the
    signal was delivered and the first exit was 143 (else two
    uninterrupted runs would compare equal and prove nothing)."""
    row = {"signal_delivered": delivered, "first_exit": first_exit,
           "signal_to_complete_seconds": seconds_to_complete,
           "signal_to_exit_seconds": seconds_to_exit}
    if rerun_exit is not None:
        row["rerun_exit"] = rerun_exit
    if not delivered:
        row["verdict"] = "not compared: no SIGTERM was delivered"
    elif first_exit != 143:
        row["verdict"] = (f"not compared: the signalled run exited "
                          f"{first_exit}, not 143")
    elif comparison is None:
        row["verdict"] = "not compared: the rerun did not end"
    else:
        row.update(comparison)
        row["verdict"] = ("resumed bit-identical" if
                          comparison.get("bit_identical") else
                          "resumed, NOT bit-identical")
    row["passed"] = row["verdict"] == "resumed bit-identical"
    return row
