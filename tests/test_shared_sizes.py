"""Datasets' sample sizes read once per diagnosis (oomdoc.capture.shared_sizes):
which dataset a file stands for, and what happens to a file that is not one."""

from __future__ import annotations

from oomdoc.capture import whole_run
from oomdoc.capture.shared_sizes import SharedSizes
from oomdoc.capture.whole_run import DatasetSizes, sample_elements


class Counted:
    """A dataset of number lists (a sample's size is its length) that counts its reads."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.reads = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> list[int]:
        self.reads += 1
        return [1] * self.lengths[index]


def sizes_of(shared: SharedSizes, dataset: Counted) -> DatasetSizes:
    key = shared.key(dataset, lambda: sample_elements(dataset[0]))
    found = shared.get(key, lambda: DatasetSizes.read(dataset), DatasetSizes.from_record)
    assert isinstance(found, DatasetSizes)
    return found


def test_a_dataset_read_by_one_replay_is_taken_by_the_next_without_reading_it(tmp_path):
    first = sizes_of(SharedSizes(str(tmp_path)), Counted([3, 9, 4]))
    assert first.sizes == [3, 9, 4] and not first.shared
    again = Counted([3, 9, 4])
    second = sizes_of(SharedSizes(str(tmp_path)), again)
    assert second.shared and second.sizes == [3, 9, 4] and second.samples == 3
    assert second.longest_first() == first.longest_first() == [1, 2, 0]
    assert again.reads == 1  # its first sample, to know it


def test_datasets_of_another_length_place_or_first_sample_are_read_for_themselves(tmp_path):
    shared = SharedSizes(str(tmp_path))
    sizes_of(shared, Counted([3, 9, 4]))
    # The same class and length, but the second of them in this replay.
    second_of_its_kind = Counted([5, 1, 2])
    assert sizes_of(shared, second_of_its_kind).sizes == [5, 1, 2]
    # Another replay: the first of its kind, but another first sample.
    other = Counted([7, 9, 4])
    assert sizes_of(SharedSizes(str(tmp_path)), other).sizes == [7, 9, 4]
    assert other.reads == 4
    assert len(list(tmp_path.glob("dataset-sizes-*.json"))) == 3


def test_a_sizes_file_that_is_not_one_is_read_again_and_rewritten(tmp_path):
    sizes_of(SharedSizes(str(tmp_path)), Counted([3, 9, 4]))
    (path,) = tmp_path.glob("dataset-sizes-*.json")
    path.write_text('{"samples": "three"}')
    dataset = Counted([3, 9, 4])
    found = sizes_of(SharedSizes(str(tmp_path)), dataset)
    assert found.sizes == [3, 9, 4] and not found.shared and dataset.reads == 4
    assert sizes_of(SharedSizes(str(tmp_path)), Counted([3, 9, 4])).shared


def test_a_dataset_that_fails_to_read_is_shared_with_its_error(tmp_path):
    class Broken(Counted):
        def __getitem__(self, index: int) -> list[int]:
            if index == 1:
                raise OSError("a missing image")
            return super().__getitem__(index)

    first = sizes_of(SharedSizes(str(tmp_path)), Broken([3, 9, 4]))
    second = sizes_of(SharedSizes(str(tmp_path)), Broken([3, 9, 4]))
    assert first.error == second.error == "reading sample 1 failed: OSError"
    assert second.shared and second.sizes == [3]


class Clocked(Counted):
    """Each sample takes 1/64 s of a clock the read is timed by."""

    def __init__(self, lengths: list[int], monkeypatch):
        super().__init__(lengths)
        self.now = 0.0
        monkeypatch.setattr(whole_run.time, "perf_counter", lambda: self.now)

    def __getitem__(self, index: int) -> list[int]:
        self.now += 1 / 64
        return super().__getitem__(index)


def test_samples_all_of_one_size_are_read_for_the_shorter_budget_only(monkeypatch):
    fixed = DatasetSizes.read(Clocked([5] * 1000, monkeypatch), budget_s=2.0, fixed_budget_s=0.125)
    assert fixed.fixed and len(fixed.sizes) == 9  # past 1/8 s
    # A sample of another size: the whole budget, to find the longest.
    lengths = [5] * 1000
    lengths[3] = 6
    varied = DatasetSizes.read(Clocked(lengths, monkeypatch), budget_s=2.0, fixed_budget_s=0.125)
    assert not varied.fixed and len(varied.sizes) == 129  # past 2 s
