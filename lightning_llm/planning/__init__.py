"""Memory and FLOP arithmetic: ZeRO stage planning, activation budgets, peak FLOP tables. No model is touched here."""
