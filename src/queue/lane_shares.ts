/**
 * Fair shares between lanes inside one worker: which lane a free slot goes
 * to, by weighted cost on a virtual clock (see {@linkcode LaneShares}).
 */

/** One message's charge against its lane's share, to be settled when the message is finished. */
export interface LaneCharge {
  readonly lane: string;
  /** The message's estimated cost. */
  readonly estimate: number;
  /** What was charged: the expected cost, divided by the lane's weight when the message started. */
  readonly weighted: number;
  readonly weight: number;
}

/**
 * How one worker shares its reads between lanes: start-time fair queueing
 * on a virtual clock measured in weighted cost (for summaries, estimated
 * tokens; by default one per message).
 *
 * Each lane has a virtual finish time: the weighted cost of everything it
 * was given (`cost / weight`). A message is charged when it starts, at its
 * estimate scaled by how the lane's recent messages really cost against
 * their estimates (a summary's estimate includes an output cap it seldom
 * uses), and settled to what it really cost when it finishes, or to its
 * estimate when that is unknown. Each read serves the
 * lane that is furthest behind. A lane that becomes active starts at the
 * clock, never below it: the *finished* service (what was given, less what
 * is still in flight) of the lanes being served now, which only moves
 * forward. So an idle tenant cannot bank credit, and a newcomer still takes
 * freed slots until it holds as much as the lanes already running. A lane
 * that cannot be served (capped, or read by other workers) does not hold the
 * clock back. A lane of weight 3 is charged a third as much per message, so
 * it gets three times the share.
 */
export interface LaneShares {
  /** Starts a read with the lanes that have work now (by `laneId`) and their weights. */
  begin(lanes: { id: string; weight: number }[]): void;
  /**
   * Which of `candidates` (in round-robin order: ties go to the first) to ask next, and for how many of
   * the `free` slots: one lane alone gets them all; otherwise enough to catch up with the next lane, or
   * an equal part of them, whichever is more.
   */
  next(candidates: string[], free: number): { lane: string; count: number };
  /** A message of `lane` estimated to cost `cost` started. */
  charge(lane: string, cost: number): LaneCharge;
  /** The message finished; `actual` is what it really cost (undefined: unknown, the estimate stands). */
  settle(charge: LaneCharge, actual?: number): void;
  /** A read found `lane` empty: when it has work again it starts from the clock. */
  drained(lane: string): void;
  /** The lane's virtual finish time, for tests and inspection. */
  finish(lane: string): number | undefined;
}

/** Defaults of {@linkcode createLaneShares}. */
export const LANE_SHARE_DEFAULTS = {
  /** Weight of each new value in the running averages (cost per message, real cost per estimated cost). */
  averaging: 0.2,
  /** The least a message is expected to cost, as a share of its estimate. */
  minRatio: 0.001,
  /** Virtual times are moved back to zero past this, so they never lose precision. */
  rebaseAt: 2 ** 40,
} as const;

/** Creates the fair-share bookkeeping of one worker. */
export function createLaneShares(): LaneShares {
  interface Lane {
    finish: number;
    /** Weighted estimates of this lane's messages still in flight here. */
    inFlight: number;
    weight: number;
    /** Running average expected cost per message; 0 until one was seen. */
    unit: number;
    /** Running average of real cost / estimate; 0 until one finished with its real cost known. */
    ratio: number;
    active: boolean;
    /** The read in which it was last given a message. */
    servedIn: number;
  }
  const lanes = new Map<string, Lane>();
  let clock = 0;
  let unit = 0;
  let ratio = 0;
  let read = 0;
  const average = (old: number, cost: number) => old === 0 ? cost : old + LANE_SHARE_DEFAULTS.averaging * (cost - old);
  const get = (id: string) => {
    let lane = lanes.get(id);
    if (!lane) {
      lanes.set(
        id,
        lane = {
          finish: clock,
          inFlight: 0,
          weight: 1,
          unit: 0,
          ratio: 0,
          active: false,
          servedIn: -1,
        },
      );
    }
    return lane;
  };

  return {
    begin(active) {
      // The clock: the finished service of the lanes being served (running here, or given a message in the last
      // read). Fair shares keep those within about a message of each other; the clock never goes back.
      let level = -Infinity;
      for (const lane of lanes.values()) {
        if (lane.inFlight > 0 || lane.servedIn === read) level = Math.max(level, lane.finish - lane.inFlight);
      }
      clock = Math.max(clock, level);
      read++;
      const seen = new Set<string>();
      for (const { id, weight } of active) {
        seen.add(id);
        const lane = get(id);
        lane.weight = weight > 0 && Number.isFinite(weight) ? weight : 1;
        // Back from idle (or new): start at the clock, not where it stopped, so no credit was banked.
        if (!lane.active) lane.finish = Math.max(lane.finish, clock);
        lane.active = true;
      }
      for (const [id, lane] of lanes) {
        if (seen.has(id)) continue;
        lane.active = false;
        // A lane at or behind the clock with nothing in flight is the same as a lane never seen.
        if (lane.inFlight <= 0 && lane.finish <= clock) lanes.delete(id);
      }
      if (clock > LANE_SHARE_DEFAULTS.rebaseAt) {
        for (const lane of lanes.values()) lane.finish -= clock;
        clock = 0;
      }
    },
    next(candidates, free) {
      let best = candidates[0]!;
      let bestLane = get(best);
      for (const id of candidates) {
        const lane = get(id);
        if (lane.finish < bestLane.finish) [best, bestLane] = [id, lane];
      }
      if (candidates.length === 1) return { lane: best, count: free };
      let second = Infinity;
      for (const id of candidates) if (id !== best) second = Math.min(second, get(id).finish);
      const perMessage = (bestLane.unit || unit || 1) / bestLane.weight;
      const catchUp = Math.ceil((second - bestLane.finish) / perMessage);
      const part = Math.floor(free / candidates.length);
      return { lane: best, count: Math.max(1, Math.min(free, Math.max(catchUp, part))) };
    },
    charge(id, cost) {
      const lane = get(id);
      const estimate = cost > 0 && Number.isFinite(cost) ? cost : 1;
      const expected = estimate * (lane.ratio || ratio || 1);
      lane.unit = average(lane.unit, expected);
      unit = average(unit, expected);
      const weighted = expected / lane.weight;
      lane.servedIn = read;
      lane.finish += weighted;
      lane.inFlight += weighted;
      return { lane: id, estimate, weighted, weight: lane.weight };
    },
    settle(charge, actual) {
      const lane = get(charge.lane);
      lane.inFlight = Math.max(0, lane.inFlight - charge.weighted);
      const known = actual !== undefined && actual >= 0 && Number.isFinite(actual);
      // A message that made no call (a duplicate, a cancel) costs nothing, but says nothing of the lane's costs.
      if (known && actual > 0) {
        const real = Math.max(LANE_SHARE_DEFAULTS.minRatio, actual / charge.estimate);
        lane.ratio = average(lane.ratio, real);
        ratio = average(ratio, real);
      }
      // Unknown (no usage reported, a failed call): the estimate stands, the cautious side.
      lane.finish += (known ? actual : charge.estimate) / charge.weight - charge.weighted;
    },
    drained(id) {
      const lane = lanes.get(id);
      if (lane) lane.active = false;
    },
    finish(id) {
      return lanes.get(id)?.finish;
    },
  };
}
