"""Self-distillation training of EAGLE heads (`eagleserve train-draft`)."""
