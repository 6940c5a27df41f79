"""Training code of the embedded demo pair (``ddtree train ...``; ``scripts/train_demo.sh`` is the real run).

Modules, in pipeline order:

    corpus      the Python stdlib sources, a stable hash-based held-out split
    tokenizer   byte-level BPE (vocab 8192) with <|endoftext|>, <|mask|> and ChatML tokens
    target      a Qwen3 target trained with transformers' Qwen3ForCausalLM, saved in Hugging Face format
    data        packed token streams and target-generated continuations (the drafter's data)
    drafter     the DFlash recipe on ddtree.models.DFlashDrafter.forward_train, saved in z-lab format
    quality     the acceptance table measured by the engine on held-out prompts
    runtime     device, seeds, LR schedule, time-budgeted step plans and JSON run logs

Nothing is imported here, so ``import ddtree.train`` stays cheap for the command line.
"""
