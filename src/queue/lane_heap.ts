/**
 * The lanes to ask, furthest behind first: a binary min-heap of entries by virtual finish time, ties by the order
 * they were pushed (round robin). A lane's place changes by pushing it again; the entry it replaces goes stale and
 * is dropped when it surfaces, or when stale entries outnumber live ones and the heap is rebuilt. Every step costs
 * O(log n) for n entries.
 */

/** An entry of the heap: its lane, the finish time it was pushed with, and its sequence number. */
export interface HeapEntry {
  finish: number;
  seq: number;
  id: string;
}

/** The heap of one worker's lanes to ask (see the module comment). */
export interface LaneHeap {
  /** Pushes `id` at `finish`. @returns the new entry's sequence number: the lane's entry from now on. */
  push(id: string, finish: number): number;
  /** The live entry furthest behind, without taking it (stale ones above it are dropped). */
  peek(): HeapEntry | undefined;
  /** Takes the live entry furthest behind. */
  pop(): HeapEntry | undefined;
  /** Moves every entry's finish time back by `by` (the clock's rebase): the order is unchanged. */
  shift(by: number): void;
}

/**
 * Creates a lane heap. `isLive(entry)`: whether the entry is its lane's current one; `live()`: how many lanes
 * have a current entry (for the rebuild).
 */
export function createLaneHeap(isLive: (entry: HeapEntry) => boolean, live: () => number): LaneHeap {
  const heap: HeapEntry[] = [];
  let seq = 0;
  const before = (a: HeapEntry, b: HeapEntry) => a.finish < b.finish || (a.finish === b.finish && a.seq < b.seq);
  const swap = (i: number, j: number) => {
    [heap[i], heap[j]] = [heap[j]!, heap[i]!];
  };
  function siftUp(i: number) {
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (!before(heap[i]!, heap[parent]!)) return;
      swap(i, parent);
      i = parent;
    }
  }
  function siftDown(i: number) {
    for (;;) {
      const l = 2 * i + 1, r = l + 1;
      let m = i;
      if (l < heap.length && before(heap[l]!, heap[m]!)) m = l;
      if (r < heap.length && before(heap[r]!, heap[m]!)) m = r;
      if (m === i) return;
      swap(i, m);
      i = m;
    }
  }
  function removeTop(): HeapEntry | undefined {
    const top = heap[0];
    const last = heap.pop();
    if (heap.length > 0 && last) {
      heap[0] = last;
      siftDown(0);
    }
    return top;
  }
  function rebuild() {
    const kept = heap.filter(isLive);
    heap.length = 0;
    heap.push(...kept);
    for (let i = (heap.length >> 1) - 1; i >= 0; i--) siftDown(i);
  }
  function peek(): HeapEntry | undefined {
    while (heap.length > 0 && !isLive(heap[0]!)) removeTop();
    return heap[0];
  }
  return {
    push(id, finish) {
      // Before the push: the entry pushed is not yet its lane's, so a rebuild after it would drop it.
      if (heap.length >= 2 * live() + 64) rebuild();
      heap.push({ finish, seq: ++seq, id });
      siftUp(heap.length - 1);
      return seq;
    },
    peek,
    pop: () => peek() && removeTop(),
    shift(by) {
      for (const entry of heap) entry.finish -= by;
    },
  };
}
