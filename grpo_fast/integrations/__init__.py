"""Drop-ins for existing trainers and loss modules (Liger's GRPO loss signature)."""
