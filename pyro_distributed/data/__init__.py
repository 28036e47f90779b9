"""Which rows of the data each worker sees, and how plates scale them.

Shards and samplers (:mod:`.shards`), plates sized by the whole data set
(:mod:`.plates`), and plate subsampling split across workers
(:mod:`.subsample`), which is also where local parameters are cut to their
worker's block.
"""
