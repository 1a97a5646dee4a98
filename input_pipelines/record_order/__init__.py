"""The global record order: which record every global batch holds, whatever
the number of workers, replicas or accumulation steps.

    index.py      per-file record offsets, stored beside the shards
    shuffle.py    a seeded permutation of an epoch's records, computed per
                  position (no table), new each epoch
    partition.py  which positions an input pipeline reads; where a resumed
                  run starts
    reader.py     reads records by number from local files (pread, a
                  bounded pool of descriptors), every record's CRC checked
    crc.py        TFRecord's masked CRC-32C of a batch of records

No TensorFlow here: the order is plain arithmetic on positions, testable on
its own (tests/test_record_order.py). `input_pipelines.tfrecord` turns it
into a tf.data pipeline.
"""
