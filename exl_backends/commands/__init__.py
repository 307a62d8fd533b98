"""What `exl bench`, `exl ppl` / `exl kld`, `exl info`, `exl quickstart` and `exl warmup` run."""
