"""Pure-torch mathematics of FedPA-LoRA: no FederatedScope, transformers or PEFT imports.

Shapes follow PEFT's LoRA: ``B`` is ``(d, r)`` (lora_B.weight, d = out_features) and ``A`` is
``(r, k)`` (lora_A.weight, k = in_features), so the adapter update is ``B @ A`` of shape ``(d, k)``.
"""
