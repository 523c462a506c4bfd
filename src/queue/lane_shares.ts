/**
 * Fair shares between lanes inside one worker: which lane a free slot goes
 * to, by weighted cost on a virtual clock (see {@linkcode LaneShares}).
 */
import { createLaneHeap } from "./lane_heap.ts";

/** One message's charge against its lane's share, to be settled when the message is finished. */
export interface LaneCharge {
  readonly lane: string;
  /** The message's estimated cost. */
  readonly estimate: number;
  /** What was charged: the expected cost, divided by the lane's weight when the message started. */
  readonly weighted: number;
  readonly weight: number;
  /**
   * The lane's virtual finish time before this message: its start tag, the order it is due in among the lanes, as
   * it was when charged. What it is now is {@linkcode LaneShares.startOf}.
   */
  readonly start: number;
  /** The lane's settled corrections and the clock's rebases when it was charged (see `startOf`). */
  readonly moved: number;
  /** The lane's running sum of them: `startOf` reads it with no look-up (a lane is kept while it has charges). */
  readonly tally: { readonly moved: number };
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
 * clock, never below it: the most *finished* service (what was given, less
 * what is still in flight) of a lane being served, taken as each message
 * settles, which only moves forward. So an idle tenant cannot bank credit,
 * and a newcomer still takes freed slots until it holds as much as the lanes
 * already running. A lane that cannot be served (capped, or read by other
 * workers) does not hold the clock back. A lane of weight 3 is charged a
 * third as much per message, so it gets three times the share.
 *
 * Every step costs the same at 10 lanes and at 20,000: the lanes to ask are
 * a heap by finish time, kept as lanes get work, drain, are charged and
 * settle, never a pass over every lane.
 */
export interface LaneShares {
  /**
   * `lane` has work: it joins the lanes served (at the clock, when it was idle or is new) with `weight`. Nothing
   * changes for a lane served already but its weight.
   */
  activate(lane: string, weight: number): void;
  /** A read found `lane` empty: it leaves the lanes served; when it has work again it starts from the clock. */
  drained(lane: string): void;
  /**
   * The lanes to ask next, furthest behind first (ties in the order they were last put back: round robin), and
   * how many of the `free` slots each: one lane alone gets them all; otherwise enough to catch up with the lane
   * behind it, or an equal part of the free slots among the lanes served, whichever is more, and at least one.
   * Each lane planned is out of the lanes to ask until {@linkcode LaneShares.putBack}; `usable` (asked of each
   * lane popped) sets aside those not to ask now, also until put back. Costs O(k log n) for k lanes planned of n.
   */
  plan(free: number, usable?: (lane: string) => boolean): { lane: string; count: number }[];
  /**
   * Puts a lane planned or set aside back among those to ask, at its finish time now (no-op when drained);
   * `stalled`: the read found it capped or failing (see {@linkcode LaneShares.behind}).
   */
  putBack(lane: string, stalled?: boolean): void;
  /** A message of `lane` estimated to cost `cost` started. */
  charge(lane: string, cost: number): LaneCharge;
  /** The message finished; `actual` is what it really cost (undefined: unknown, the estimate stands). */
  settle(charge: LaneCharge, actual?: number): void;
  /**
   * A charge's start tag now: where it was charged, moved by the corrections its lane settled since (what messages
   * charged before it really cost; one charged after it seldom settles first, as it starts only after it) and by the
   * clock's rebases. So a message read ahead before costs were known (a worker's first are charged their whole
   * estimate) is due again once the messages ahead of it settle at what they really cost.
   */
  startOf(charge: LaneCharge): number;
  /**
   * Whether a lane with work (the first to ask, or one planned and being read) is due before a message so charged
   * (its start tag now: see {@linkcode LaneShares.startOf}): a message read ahead then waits for that lane's read. A
   * lane a read found capped or failing is not, until it gets work, starts a message or settles one.
   */
  behind(charge: LaneCharge): boolean;
  /** The lane's virtual finish time, for tests and inspection. */
  finish(lane: string): number | undefined;
  /** How many lanes are served (have work, as far as this worker knows), and how many it keeps figures of. */
  size(): { active: number; known: number };
}

/** Defaults of {@linkcode createLaneShares}. */
export const LANE_SHARE_DEFAULTS = {
  /** Weight of each new value in the running averages (cost per message, real cost per estimated cost). */
  averaging: 0.2,
  /** The least a message is expected to cost, as a share of its estimate. */
  minRatio: 0.001,
  /** Virtual times are moved back to zero past this, so they never lose precision. */
  rebaseAt: 2 ** 40,
  /** Lanes looked at per plan for figures no longer needed (idle, at or behind the clock): forgetting is spread. */
  forgetPerPlan: 16,
  /**
   * A lane that gets work again within this many plans of being drained keeps its virtual time instead of starting
   * at the clock: a take that drains a lane says so at once, and a burst's next job is often a few ms behind.
   */
  refillGracePlans: 4,
} as const;

interface Lane {
  finish: number;
  /** Weighted estimates of this lane's messages still in flight here. */
  inFlight: number;
  weight: number;
  /** Running average expected cost per message; 0 until one was seen. */
  unit: number;
  /** Running average of real cost / estimate; 0 until one finished with its real cost known. */
  ratio: number;
  /** Has work, as far as this worker knows. */
  active: boolean;
  /** The sequence number of its live entry in the heap; 0 when it has none (planned, set aside, or drained). */
  entry: number;
  /** The plan in which it was last drained (see `refillGracePlans`). */
  drainedIn: number;
  /** A read found it capped or failing: it holds back no message read ahead until it starts or settles one. */
  stalled: boolean;
  /**
   * The sum of its settled corrections (real cost less the charge), less the clock's rebases: a charge's start tag
   * moves by how much this changed since it was charged.
   */
  moved: number;
}

/**
 * How many of `free` slots a plan gives `lane` when `served` lanes have work: enough to catch up with the lane
 * behind it (finish time `behind`), or an equal part, whichever is more, and at least one.
 */
function countFor(lane: Lane, behind: number, unit: number, free: number, served: number): number {
  const perMessage = (lane.unit || unit || 1) / lane.weight;
  const catchUp = Math.ceil((behind - lane.finish) / perMessage);
  return Math.max(1, Math.min(free, Math.max(catchUp, Math.floor(free / served))));
}

/** A lane this worker has no figures of yet, at `clock`. */
function newLane(clock: number): Lane {
  return {
    finish: clock,
    inFlight: 0,
    weight: 1,
    unit: 0,
    ratio: 0,
    active: false,
    entry: 0,
    drainedIn: -Infinity,
    stalled: false,
    moved: 0,
  };
}

/**
 * Forgets a few lanes whose figures say nothing any more (idle, nothing in flight, at or behind the clock), walking
 * `lanes` from `forgetting` on. @returns where the next walk goes on.
 */
function forgetIdle(
  lanes: Map<string, Lane>,
  forgetting: Iterator<[string, Lane]>,
  plans: number,
  clock: number,
): Iterator<[string, Lane]> {
  for (let i = 0; i < LANE_SHARE_DEFAULTS.forgetPerPlan; i++) {
    let next = forgetting.next();
    if (next.done) {
      forgetting = lanes.entries();
      next = forgetting.next();
      if (next.done) break;
    }
    const [id, lane] = next.value;
    const idle = !lane.active && plans - lane.drainedIn > LANE_SHARE_DEFAULTS.refillGracePlans;
    if (idle && lane.inFlight <= 0 && lane.finish <= clock && lane.entry === 0) lanes.delete(id);
  }
  return forgetting;
}

/** Creates the fair-share bookkeeping of one worker. */
export function createLaneShares(): LaneShares {
  const lanes = new Map<string, Lane>();
  let live = 0; // lanes with an entry in the heap
  const heap = createLaneHeap((e) => lanes.get(e.id)?.entry === e.seq, () => live);
  let clock = 0;
  let unit = 0;
  let ratio = 0;
  let active = 0;
  let plans = 0;
  let forgetting: Iterator<[string, Lane]> = lanes.entries();
  // Lanes planned and not yet put back (a read is taking from them): still due where their finish times say.
  const planned = new Set<Lane>();
  const average = (old: number, cost: number) => old === 0 ? cost : old + LANE_SHARE_DEFAULTS.averaging * (cost - old);
  const get = (id: string) => {
    let lane = lanes.get(id);
    if (!lane) lanes.set(id, lane = newLane(clock));
    return lane;
  };
  /** Puts `id` among the lanes to ask at its finish time now (its older entry, if any, goes stale). */
  function push(id: string, lane: Lane) {
    if (lane.entry === 0) live++;
    lane.entry = heap.push(id, lane.finish);
  }
  /** Takes `id` out of the lanes to ask (its heap entry goes stale). */
  function take(lane: Lane) {
    if (lane.entry !== 0) live--;
    lane.entry = 0;
    planned.delete(lane);
  }
  const forget = () => forgetting = forgetIdle(lanes, forgetting, plans, clock);
  const startOf = (charge: LaneCharge) => charge.start + charge.tally.moved - charge.moved;
  /** The clock: the finished service of the lanes served, which only moves forward. */
  function advance(lane: Lane) {
    clock = Math.max(clock, lane.finish - lane.inFlight);
    if (clock > LANE_SHARE_DEFAULTS.rebaseAt) {
      for (const l of lanes.values()) {
        l.finish -= clock;
        l.moved -= clock;
      }
      heap.shift(clock);
      clock = 0;
    }
  }

  return {
    activate(id, weight) {
      const lane = get(id);
      lane.weight = weight > 0 && Number.isFinite(weight) ? weight : 1;
      // Work came (a wake-up names it): worth a read again.
      lane.stalled = false;
      if (lane.active) return;
      // Back from idle (or new): start at the clock, not where it stopped, so no credit was banked; unless it was
      // drained only a few plans ago (a burst whose jobs arrive a few ms apart keeps its place, as it did when a
      // lane left only once a take found it empty).
      if (plans - lane.drainedIn > LANE_SHARE_DEFAULTS.refillGracePlans) lane.finish = Math.max(lane.finish, clock);
      lane.active = true;
      active++;
      push(id, lane);
    },
    drained(id) {
      const lane = lanes.get(id);
      if (!lane?.active) return;
      lane.active = false;
      lane.drainedIn = plans;
      active--;
      take(lane);
    },
    plan(free, usable) {
      plans++;
      forget();
      const plan: { lane: string; count: number }[] = [];
      const served = live;
      while (free > 0) {
        const top = heap.pop();
        if (!top) break;
        const lane = lanes.get(top.id)!;
        take(lane);
        if (usable && !usable(top.id)) continue;
        const count = served > 1 ? countFor(lane, heap.peek()?.finish ?? lane.finish, unit, free, served) : free;
        plan.push({ lane: top.id, count });
        planned.add(lane);
        free -= count;
      }
      return plan;
    },
    putBack(id, stalled = false) {
      const lane = lanes.get(id);
      if (!lane) return;
      planned.delete(lane);
      lane.stalled = stalled;
      if (lane.active) push(id, lane);
    },
    charge(id, cost) {
      const lane = get(id);
      const estimate = cost > 0 && Number.isFinite(cost) ? cost : 1;
      const expected = estimate * (lane.ratio || ratio || 1);
      lane.unit = average(lane.unit, expected);
      unit = average(unit, expected);
      const weighted = expected / lane.weight;
      const start = lane.finish;
      lane.stalled = false;
      lane.finish += weighted;
      lane.inFlight += weighted;
      if (lane.entry !== 0) push(id, lane);
      return { lane: id, estimate, weighted, weight: lane.weight, start, moved: lane.moved, tally: lane };
    },
    settle(charge, actual) {
      const lane = get(charge.lane);
      lane.inFlight = Math.max(0, lane.inFlight - charge.weighted);
      lane.stalled = false;
      const known = actual !== undefined && actual >= 0 && Number.isFinite(actual);
      // A message that made no call (a duplicate, a cancel) costs nothing, but says nothing of the lane's costs.
      if (known && actual > 0) {
        const real = Math.max(LANE_SHARE_DEFAULTS.minRatio, actual / charge.estimate);
        lane.ratio = average(lane.ratio, real);
        ratio = average(ratio, real);
      }
      // Unknown (no usage reported, a failed call): the estimate stands, the cautious side.
      const correction = (known ? actual : charge.estimate) / charge.weight - charge.weighted;
      lane.finish += correction;
      // The messages charged after it, still waiting or running, are due that much sooner (or later).
      lane.moved += correction;
      // Its place among the lanes to ask follows its finish time.
      if (lane.entry !== 0) push(charge.lane, lane);
      advance(lane);
    },
    startOf,
    behind(charge) {
      const start = startOf(charge);
      // Only the first lane to ask is looked at: a stalled one there holds nothing back, as before read-ahead waited.
      const top = heap.peek();
      const first = top && lanes.get(top.id)!;
      if (first && !first.stalled && first.finish < start) return true;
      for (const lane of planned) if (lane.finish < start) return true;
      return false;
    },
    finish(id) {
      return lanes.get(id)?.finish;
    },
    size: () => ({ active, known: lanes.size }),
  };
}
