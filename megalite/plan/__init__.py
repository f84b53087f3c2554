"""Planning a run before it starts, `pretrain_gpt.py --dry-run`: dry_run.py builds every pipeline rank's
model on the meta device and prints what each rank needs; memory.py gives the bytes in closed form."""
