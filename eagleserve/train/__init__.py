"""Self-distillation training of EAGLE heads (`eagleserve train-draft`).

Imports: spec/ and everything below it (never scheduler/ or server/).
"""
