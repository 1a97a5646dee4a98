"""The step's row, read by name (`tfscale/step/row.py`): each number where
the layout says, on the host and in the noise scale's numbers."""

from tfscale.step.row import NoiseNumbers, RowLayout


def test_each_number_is_where_the_layout_names_it():
    row = RowLayout(noise_groups=2)
    assert (row.replica_width, row.reduced_width, row.size) == (4, 7, 11)
    # [loss, stop, preempt, pace, small x2, count, big x2, ready, skipped]
    steps = [[0.5, 0.0, 0.0, 40.0, 1.0, 2.0, 4.0, 3.0, 5.0, 1.0, 0.0],
             [0.25, 1.0, 2.0, 40.0, 6.0, 7.0, 4.0, 8.0, 9.0, 0.0, 1.0]]
    result = row.result(steps, {"mae": 0.1})
    assert result.losses == (0.5, 0.25) and result.steps == 2
    assert (result.stop, result.preempt, result.skipped) == (True, True, 1)
    assert result.pace == 40.0
    assert result.noise == (NoiseNumbers((1.0, 2.0), 4.0, (3.0, 5.0), 1.0),
                            NoiseNumbers((6.0, 7.0), 4.0, (8.0, 9.0), 0.0))
    assert result.metrics == {"mae": 0.1}


def test_without_the_noise_scale_the_row_is_loss_flags_and_skip():
    row = RowLayout()
    assert (row.replica_width, row.reduced_width, row.size) == (1, 4, 5)
    result = row.result([[0.5, 0.0, 1.0, 8.0, 1.0]], {})
    assert (result.losses, result.stop, result.preempt, result.skipped,
            result.noise, result.pace) == ((0.5,), False, True, 1, (), 8.0)
