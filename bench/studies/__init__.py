"""Studies built on the compiler, not part of its flow: the paper-scale ablation and the bench runner."""
