"""Arrow schemas of every table that crosses a task boundary: one place for each fact.

Per-token columns are `list<...>` aligned with `input_ids`. A nullable per-token column means "the default"
(see `TRAINING_SAMPLE_DEFAULTS`); after packing every per-token column is materialised with exactly
`len(input_ids)` entries.
"""

from __future__ import annotations

import pyarrow as pa

# --- reward models -------------------------------------------------------------------------------------------

PAIRS = pa.schema([
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("chosen", pa.string(), nullable=False),
    pa.field("rejected", pa.string(), nullable=False),
    pa.field("margin", pa.float64(), nullable=True),
    pa.field("source_line", pa.int64(), nullable=False),  # 1-based line in the JSONL file, for errors
])

TOKENIZED_PAIRS = pa.schema([
    pa.field("chosen_input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("rejected_input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("margin", pa.float64(), nullable=True),
    pa.field("source_line", pa.int64(), nullable=False),
])

# One row per optimizer step: which rows of the tokenized table form its minibatch.
BATCH_PLAN = pa.schema([
    pa.field("step", pa.int64(), nullable=False),
    pa.field("row_indices", pa.list_(pa.int64()), nullable=False),
])

# One row per held-out pair of a reward model's evaluation (rm/evaluate.py), in the TOKENIZED_PAIRS table's order
# (`pair_index`, which is also the PAIRS table's row). loss: -log σ(r_chosen - r_rejected), whose mean is the
# evaluation's loss; correct: r_chosen > r_rejected (a tie is wrong, as in the accuracy).
RM_EVAL_ROWS = pa.schema([
    pa.field("pair_index", pa.int64(), nullable=False),
    pa.field("source_line", pa.int64(), nullable=False),
    pa.field("r_chosen", pa.float64(), nullable=False),
    pa.field("r_rejected", pa.float64(), nullable=False),
    pa.field("margin", pa.float64(), nullable=False),  # r_chosen - r_rejected
    pa.field("loss", pa.float64(), nullable=False),
    pa.field("correct", pa.bool_(), nullable=False),
])

# (prompt, response) rows to score with a reward model, and their scores.
RESPONSES = pa.schema([
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("response", pa.string(), nullable=False),
    pa.field("source_line", pa.int64(), nullable=False),
])
SCORED_RESPONSES = RESPONSES.append(pa.field("reward", pa.float64(), nullable=False))

# --- SFT -----------------------------------------------------------------------------------------------------

# A conversation as a list of {role, content}; prompt/completion rows become [user, assistant].
MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])
# An SFT message may also carry OpenAI tool calls (data/tool_messages.py): an assistant's calls, each with its
# arguments as the JSON text of an object, and a tool message's call id and tool name; null where a row has none.
TOOL_CALL = pa.struct([pa.field("id", pa.string()), pa.field("name", pa.string()),
                       pa.field("arguments", pa.string())])
CHAT_MESSAGE = pa.struct([*MESSAGE, pa.field("tool_calls", pa.list_(TOOL_CALL)),
                          pa.field("tool_call_id", pa.string()), pa.field("name", pa.string())])
EXAMPLES = pa.schema([
    pa.field("messages", pa.list_(CHAT_MESSAGE), nullable=False),
    pa.field("source_line", pa.int64(), nullable=False),
    # The row's tools (OpenAI function schemas, as the chat template's `tools=` takes them) as JSON text; null: none.
    pa.field("tools", pa.string(), nullable=True),
])


def sft_sample_id(source_line: int) -> str:
    """The sample id of an EXAMPLES row's training sample (sft/tokenize.py), which eval rows are read back by."""
    return f"line-{source_line}"


# One row per held-out SFT example of an evaluation (sft/evaluate.py), in the eval samples' order: its NLL summed
# over its trained tokens (ce weights), their count, and their mean. Σ nll_sum / Σ tokens is the evaluation's loss.
SFT_EVAL_ROWS = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("nll_sum", pa.float64(), nullable=False),
    pa.field("tokens", pa.int64(), nullable=False),
    pa.field("loss", pa.float64(), nullable=False),
])

# --- RL ------------------------------------------------------------------------------------------------------

PROMPTS = pa.schema([
    pa.field("example_id", pa.string(), nullable=False),
    pa.field("env", pa.string(), nullable=False),
    pa.field("messages", pa.list_(MESSAGE), nullable=False),
    pa.field("answer", pa.string(), nullable=True),
    pa.field("info", pa.string(), nullable=True),  # JSON text: free-form per-example metadata
    pa.field("source_line", pa.int64(), nullable=True),
])

# One segment of a multi-turn completion: a model turn (sampled = True: the policy drew these tokens) or a message
# the environment wrote (sampled = False) under `role`. start/length locate its tokens in completion_ids; body_start /
# body_length locate the tokens of its content alone (an env message's segment also holds the chat template's framing:
# the role header, the end-of-turn token, the next generation prompt). Segments tile completion_ids in order.
TURN = pa.struct([
    pa.field("role", pa.string(), nullable=False),
    pa.field("sampled", pa.bool_(), nullable=False),
    pa.field("start", pa.int32(), nullable=False),
    pa.field("length", pa.int32(), nullable=False),
    pa.field("body_start", pa.int32(), nullable=False),
    pa.field("body_length", pa.int32(), nullable=False),
    pa.field("content", pa.string(), nullable=False),
])

# One training sequence of an agent episode before its last: the request it was sampled from, then its tokens.
EARLIER_SEQUENCE = pa.struct([
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("sampling_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("completion_turns", pa.list_(TURN), nullable=False),
])

ROLLOUTS = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("example_id", pa.string(), nullable=False),
    pa.field("env", pa.string(), nullable=False),
    pa.field("group_index", pa.int32(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
    # One per completion token: the logprob the sampler drew it with; null on tokens the environment wrote.
    pa.field("sampling_logprobs", pa.list_(pa.float32()), nullable=False),
    # Single-turn: the completion decoded. Multi-turn: the whole episode after the prompt, decoded.
    pa.field("completion_text", pa.string(), nullable=False),
    pa.field("answer", pa.string(), nullable=True),
    pa.field("info", pa.string(), nullable=True),
    pa.field("reward", pa.float64(), nullable=True),  # null = missing (the error says why)
    pa.field("reward_error", pa.string(), nullable=True),
    # Multi-turn envs only (null: one model turn, every completion token sampled by the policy): per-token
    # attribution as segments (TURN), and the episode as JSON {"state", "turns", "end"} (envs/episodes.py).
    pa.field("completion_turns", pa.list_(TURN), nullable=True),
    pa.field("episode", pa.string(), nullable=True),
    # What the completions were sampled from: the live policy's state id (a checkpoint id or an RL pending-step
    # record id: the weights the sampler ran, on the embedded sampler or the reloaded policy server), or for a
    # frozen source `frozen:<identity>` (`served:<name>` for a server you run; the checkpoint id or content
    # digest of a model rollout serves). Null only in hand-made tables.
    pa.field("sampled_from", pa.string(), nullable=True),
    # Partial rollouts only (rl/partial.py; null otherwise: every token drawn by `sampled_from`): one per
    # completion token, the policy version that drew it (the step whose resulting state sampled it, 0 the initial
    # policy), and the step whose draw the prompt came from. `sampled_from` then names the newest state.
    pa.field("token_policy_versions", pa.list_(pa.int32()), nullable=True),
    pa.field("drawn_at_step", pa.int32(), nullable=True),
    # Partial rollouts on an engine (whose logprob bits vary with batch composition): one per completion token,
    # the trainer's logprob of it under the version that drew it, computed by the stage that drew it (bit-stable);
    # the behaviour logprob the training samples take instead of `sampling_logprobs`. Null elsewhere.
    pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=True),
    # An agent episode whose history was rewritten (envs/agent_tokens.py): its training sequences before the last
    # (the row's own prompt and completion are the last), each trained with the episode's advantage
    # (algo/stamping.py). Null: the episode is one sequence, as every other rollout.
    pa.field("earlier_sequences", pa.list_(EARLIER_SEQUENCE), nullable=True),
])

# Partial rollouts in flight between two sample stages (rl/partial.py): ROLLOUTS rows of the groups not yet
# complete (rewards null), each marked `finished` when its own completion has ended (EOS or max_tokens).
IN_FLIGHT = pa.schema([*ROLLOUTS, pa.field("finished", pa.bool_(), nullable=False)])

# --- training samples and micro-batches (shared by SFT and RL) ----------------------------------------------

TOKEN_INT_COLUMNS = ("input_ids",)
# An optional per-token stream (below): absent from a table stored before it, null where no correction needs it.
SAMPLER_LOGPROBS = "sampler_logprobs"

# The per-token streams the loss reads (losses.component_loss), in a fixed order ...
LOSS_STREAMS = (
    "loss_mask",
    "advantages",
    "rl_weights",
    "ce_weights",
    "ref_kl_weights",
    "ref_logprobs",
    "inference_logprobs",
)
# ... and the float ones with the stream the forward pass reads (packing.token_logprobs scales logits by it).
TOKEN_FLOAT_COLUMNS = (*LOSS_STREAMS[1:], "temperatures")
# Per-token columns of a micro-batch besides input_ids (and position_ids).
STREAM_COLUMNS = ("loss_mask", *TOKEN_FLOAT_COLUMNS)
PER_TOKEN_COLUMNS = ("input_ids", *STREAM_COLUMNS)

TRAINING_SAMPLES = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("env", pa.string(), nullable=True),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
    # Nullable streams: null means the default in TRAINING_SAMPLE_DEFAULTS. inference_logprobs: the behaviour
    # policy's logprob of each token (the importance ratio's denominator); NaN: the behaviour policy is the
    # state this step trains from, so the trainer takes the training forward's own detached logprob
    # (behaviour_logprobs = "training_forward", rl/behaviour.py; ratio exactly 1). temperatures: the temperature
    # each token was sampled at, which the trainer divides that token's logits by (importance ratio 1
    # on-policy).
    *[pa.field(name, pa.list_(pa.float32()), nullable=True) for name in TOKEN_FLOAT_COLUMNS],
    # The sampler's own logprob of each token, kept beside `inference_logprobs` where those are not the sampler's
    # (the trainer's recompute, the training forward) and a mismatch correction reweights against the sampler
    # (rl_losses/correction.py). Null: `inference_logprobs` are the sampler's, or no correction needs them.
    pa.field(SAMPLER_LOGPROBS, pa.list_(pa.float32()), nullable=True),
])

# What a null stream means, per position. rl_weights: 1.0 on every loss_mask token (the "loss_mask" form, which the
# packer materialises), so plain rl ships no weight stream; a sample that must stay out of rl (SFT, distillation, a
# missing reward) ships zeros. Every other stream: its value everywhere, so a sample only enters the ce or ref_kl
# component whose weights it ships. A component's other inputs have no default worth guessing: a sample with rl
# tokens and null advantages or inference_logprobs, or with ref_kl tokens and null ref_logprobs or
# inference_logprobs, is a producer bug that packing raises (REQUIRED_STREAMS).
TRAINING_SAMPLE_DEFAULTS = {
    "advantages": 0.0,
    "rl_weights": "loss_mask",
    "ce_weights": 0.0,
    "ref_kl_weights": 0.0,
    "ref_logprobs": 0.0,
    "inference_logprobs": 0.0,
    "temperatures": 1.0,  # unscaled logits (SFT, and RL sampled at temperature 1)
}
# The streams a component's loss reads besides its weights (losses.rl_loss_terms, losses.ref_kl_loss_terms).
REQUIRED_STREAMS = {
    "rl": ("advantages", "inference_logprobs"),
    "ref_kl": ("ref_logprobs", "inference_logprobs"),
}

# Behaviour logprobs a streamed off-policy step computed while it sampled (rl/behaviour_stream.py): one row per
# rollouts row of each chunk it finished, in chunk order. The advantages stage adopts a chunk only where its rows
# and its forward inputs (`inputs_digest`, rl/behaviour.py ForwardInputs) are the recompute's.
BEHAVIOUR_LOGPROBS = pa.schema([
    pa.field("chunk", pa.int32(), nullable=False),  # index among the recompute's chunks (rl/behaviour.py)
    pa.field("row", pa.int32(), nullable=False),  # the rollouts row
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("inputs_digest", pa.string(), nullable=False),
    # Aligned with the sample's input_ids: log p(token t | tokens before it), 0.0 where loss_mask is false.
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
])

# One row per micro-batch: the concatenation of its samples, with per-sequence position ids restarting at 0 (at its
# shared prefix's length for a sequence that shares one).
MICRO_BATCHES = pa.schema([
    pa.field("micro_batch_index", pa.int32(), nullable=False),
    pa.field("sample_ids", pa.list_(pa.string()), nullable=False),
    pa.field("sequence_lengths", pa.list_(pa.int32()), nullable=False),
    # Per sequence: its leading tokens not stored here because they are the first tokens of the micro-batch's
    # latest unshared sequence before it (the group's prompt, trained once; packing.py, "Shared prefixes").
    # 0 for a sequence stored whole; its position ids start at this number.
    pa.field("shared_prefix_lengths", pa.list_(pa.int32()), nullable=False),
    pa.field("position_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
    *[pa.field(name, pa.list_(pa.float32()), nullable=False) for name in TOKEN_FLOAT_COLUMNS],
    # Null unless a sample of the micro-batch carries it; then one per token, NaN on the samples without it.
    pa.field(SAMPLER_LOGPROBS, pa.list_(pa.float32()), nullable=True),
])

# Nullable columns added after tables were stored without them: read back as null (every row), not refused.
LATER_COLUMNS = (SAMPLER_LOGPROBS, "tools", "earlier_sequences")


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Cast a table to a declared schema, failing with the offending column named."""
    for name in LATER_COLUMNS:
        if name in schema.names and name not in table.column_names:
            table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise ValueError(f"table is missing column(s) {missing} of schema {schema.names}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(f"table does not conform to its wire schema: {exc}") from exc
