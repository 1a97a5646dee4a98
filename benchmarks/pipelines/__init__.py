"""Input pipelines and record writers: is the input ever the bottleneck?

- `input_pipeline.py`: the BERT records' pipeline against its ceiling
- `image_pipeline.py`: the ImageNet pipeline's images/s against its ceiling and
  Model Garden's
- `record_reader.py`: what reading records by number costs
- `data_service.py`: the tf.data service against local input
- `data_service_trainer.py`: one trainer of data_service.py
- `iterator_deletion.py`: how often deleting a tf.data iterator stalls
- `iterator_deletion_worker.py`: one worker of iterator_deletion.py
- `writers.py`: the record writers' throughput on the prepare engine
- `writer_memory.py`: the BERT writer's peak memory against its input
"""
