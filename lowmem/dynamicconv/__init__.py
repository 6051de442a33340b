"""The DynamicConv track: the corpus, fairseq's CLI runs, the fairseq plugin's model and task (``plugin``, loaded
through ``lowmem/fairseq_user_dir/lowmem_fairseq``) and the accountant's peak of one fairseq update."""
