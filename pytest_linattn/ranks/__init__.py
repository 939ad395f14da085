"""Running one function on several ranks: the spawned rank pool (`pool`, the parent's side;
`worker`, what runs in a rank), torchrun's existing world (`launcher`), where a call goes
(`dispatch.run_on_ranks`), the failure and hang reports (`reports`) and GPU leases (`gpus`).
Plain modules: they work without pytest."""
