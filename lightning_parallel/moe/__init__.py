"""A Hugging Face mixture of experts, model side: its experts modules found and read (``experts``), placed
whole on the ranks of an ep group with the tokens sent to them by all-to-all (``expert_parallel``), that
all-to-all's volume per step for the plan table (``expert_traffic``), and the load-balancing loss on the
global batch (``load_balancing``). Tensor parallelism's split of each expert (``tensor.expert_layer``) and
the strategy's ep axis (``strategies.expert_stages``) build on it."""
