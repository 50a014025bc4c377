"""Stand-ins for a step's compilers that record what is queued and asked for, so that the
choices of the prefetcher and the fallback are tested without compiling anything."""


class RecordingCompiler:
  """Stands in for a StepCompiler: ``queued`` are the sizes prefetched, ``first`` the sizes
  queued ahead of the others, ``got`` the sizes asked for."""

  def __init__(self):
    self.queued, self.first, self.got = [], [], []

  def prefetch(self, sizes, *, first=False):
    (self.first if first else self.queued).append(list(sizes))

  def get(self, size):
    self.got.append(size)


class RecordingUpdate:
  """Stands in for the update's ProgramCompiler: counts its prefetches and gets."""

  def __init__(self):
    self.prefetches = self.gets = 0

  def prefetch(self):
    self.prefetches += 1

  def get(self):
    self.gets += 1


class RecordingCompilers:
  """Stands in for StepCompilers; ``compiled`` is its view."""

  def __init__(self, compiled=None):
    self.compiled = compiled
    self.fused, self.micro, self.update = (
      RecordingCompiler(),
      RecordingCompiler(),
      RecordingUpdate(),
    )

  def view(self):
    return self.compiled
