/**
 * Server-side request forgery rules for webhook URLs. A tenant chooses the
 * URL, and the relay posts to it from inside our network, so a URL must
 * never reach loopback, the private network or the cloud metadata service
 * (169.254.169.254), whether by an IP literal or by a name resolving there.
 */
import { ConnectionError, isNotCapable, PermissionDenied } from "../retry/errors.ts";

/** Whether plain http and private addresses are allowed (both off in production). */
export interface WebhookUrlPolicy {
  allowHttp: boolean;
  allowPrivate: boolean;
}

/** Looks up the addresses of a host name. */
export type ResolveHost = (host: string) => Promise<string[]>;

/** A webhook URL or address we will not send to. Permanent: no retry can change the answer. */
export class WebhookRefused extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "WebhookRefused";
  }
}

/** The longest webhook URL accepted. */
export const MAX_WEBHOOK_URL_LENGTH = 2048;

// [first address, prefix length] of every IPv4 block that is not on the public internet.
const IPV4_NOT_PUBLIC: ReadonlyArray<readonly [string, number]> = [
  ["0.0.0.0", 8], // "this network"
  ["10.0.0.0", 8],
  ["100.64.0.0", 10], // carrier-grade NAT
  ["127.0.0.0", 8],
  ["169.254.0.0", 16], // link-local, the cloud metadata service
  ["172.16.0.0", 12],
  ["192.0.0.0", 24],
  ["192.0.2.0", 24],
  ["192.168.0.0", 16],
  ["198.18.0.0", 15],
  ["198.51.100.0", 24],
  ["203.0.113.0", 24],
  ["224.0.0.0", 4], // multicast
  ["240.0.0.0", 4], // reserved, and 255.255.255.255
];

/** `a.b.c.d` as a 32-bit number; leading zeros are refused (some parsers read them as octal). */
function parseIPv4(text: string): number | undefined {
  const parts = text.split(".");
  if (parts.length !== 4) return undefined;
  let value = 0;
  for (const part of parts) {
    if (!/^(0|[1-9]\d{0,2})$/.test(part) || Number(part) > 255) return undefined;
    value = value * 256 + Number(part);
  }
  return value;
}

/** An IPv6 literal as 16 bytes: `::` compression and a trailing dotted quad allowed, zone ids not. */
function parseIPv6(text: string): Uint8Array | undefined {
  if (text.includes("%")) return undefined;
  const halves = text.split("::");
  if (halves.length > 2) return undefined;
  const groups = (half: string): number[] | undefined => {
    if (half === "") return [];
    const out: number[] = [];
    const pieces = half.split(":");
    for (const [i, piece] of pieces.entries()) {
      if (i === pieces.length - 1 && piece.includes(".")) {
        const v4 = parseIPv4(piece);
        if (v4 === undefined) return undefined;
        out.push(v4 >>> 16, v4 & 0xffff);
      } else if (/^[0-9a-f]{1,4}$/i.test(piece)) {
        out.push(parseInt(piece, 16));
      } else {
        return undefined;
      }
    }
    return out;
  };
  const head = groups(halves[0]!);
  const tail = halves.length === 2 ? groups(halves[1]!) : [];
  if (!head || !tail) return undefined;
  // A dotted quad is only allowed at the very end.
  if (halves.length === 2 && halves[0]!.includes(".")) return undefined;
  const missing = 8 - head.length - tail.length;
  if (halves.length === 2 ? missing < 1 : missing !== 0) return undefined;
  const all = [...head, ...new Array<number>(missing).fill(0), ...tail];
  const bytes = new Uint8Array(16);
  all.forEach((group, i) => {
    bytes[2 * i] = group >> 8;
    bytes[2 * i + 1] = group & 0xff;
  });
  return bytes;
}

function ipv4InBlock(value: number, base: string, prefix: number): boolean {
  const shift = 32 - prefix;
  return Math.floor(value / 2 ** shift) === Math.floor(parseIPv4(base)! / 2 ** shift);
}

function isPublicIPv4(value: number): boolean {
  return !IPV4_NOT_PUBLIC.some(([base, prefix]) => ipv4InBlock(value, base, prefix));
}

/** Whether the first `bits` bits of `bytes` equal those of `prefix`. */
function hasPrefix(bytes: Uint8Array, prefix: readonly number[], bits: number): boolean {
  for (let bit = 0; bit < bits; bit += 8) {
    const mask = bits - bit >= 8 ? 0xff : (0xff << (8 - (bits - bit))) & 0xff;
    if (((bytes[bit / 8]! ^ (prefix[bit / 8] ?? 0)) & mask) !== 0) return false;
  }
  return true;
}

function embeddedIPv4(bytes: Uint8Array, offset: number): number {
  return ((bytes[offset]! << 24) >>> 0) + (bytes[offset + 1]! << 16) + (bytes[offset + 2]! << 8) + bytes[offset + 3]!;
}

function isPublicIPv6(bytes: Uint8Array): boolean {
  // These carry an IPv4 address that the network will reach: judge that one.
  if (hasPrefix(bytes, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff], 96)) return isPublicIPv4(embeddedIPv4(bytes, 12));
  if (hasPrefix(bytes, [0, 0x64, 0xff, 0x9b], 96)) return isPublicIPv4(embeddedIPv4(bytes, 12)); // NAT64
  if (hasPrefix(bytes, [0x20, 0x02], 16)) return isPublicIPv4(embeddedIPv4(bytes, 2)); // 6to4
  // Only global unicast is public. That excludes ::, ::1, the deprecated
  // IPv4-compatible ::a.b.c.d, 100::/64, fc00::/7, fe80::/10 and ff00::/8.
  if (!hasPrefix(bytes, [0x20], 3)) return false;
  if (hasPrefix(bytes, [0x20, 0x01, 0x0d, 0xb8], 32)) return false; // documentation
  if (hasPrefix(bytes, [0x20, 0x01, 0x00], 23)) return false; // IETF protocol assignments (Teredo, benchmarking)
  return true;
}

/**
 * Whether an IPv4 or IPv6 literal (no brackets) is on the public internet.
 * Anything unparseable, or an IPv6 literal with a zone id, is not.
 */
export function isPublicAddress(ip: string): boolean {
  if (ip.includes(":")) {
    const bytes = parseIPv6(ip);
    return bytes !== undefined && isPublicIPv6(bytes);
  }
  const value = parseIPv4(ip);
  return value !== undefined && isPublicIPv4(value);
}

/** Whether `text` is an IPv4 or IPv6 literal (no brackets, no zone id). */
export function isIpAddress(text: string): boolean {
  return text.includes(":") ? parseIPv6(text) !== undefined : parseIPv4(text) !== undefined;
}

/** The URL's host as an IP literal without brackets, or undefined for a name. */
function ipLiteralOf(url: URL): string | undefined {
  const host = url.hostname;
  if (host.startsWith("[") && host.endsWith("]")) return host.slice(1, -1);
  // The URL parser has already turned every numeric IPv4 form (0x7f.1, 2130706433) into a dotted quad.
  return parseIPv4(host) === undefined ? undefined : host;
}

/** `localhost` and `*.localhost` always mean loopback (RFC 6761), whatever DNS says. */
function isLocalhostName(host: string): boolean {
  const name = host.toLowerCase().replace(/\.$/, "");
  return name === "localhost" || name.endsWith(".localhost");
}

function refusePrivate(address: string): never {
  throw new WebhookRefused(`webhook URL points at a private or loopback address (${address})`);
}

/**
 * Checks a webhook URL when a client submits it, without DNS: an absolute
 * https URL (http only when `allowHttp`), no credentials, at most 2048
 * characters, and not a private or loopback IP literal or `localhost` name
 * unless `allowPrivate`. A name is only checked again, after resolution, by
 * {@linkcode resolvePublic} at send time.
 * @throws {WebhookRefused} with a message the client can act on.
 */
export function checkWebhookUrl(raw: string, policy: WebhookUrlPolicy): URL {
  if (raw.length > MAX_WEBHOOK_URL_LENGTH) {
    throw new WebhookRefused(`webhook URL is too long (${raw.length} characters, at most ${MAX_WEBHOOK_URL_LENGTH})`);
  }
  const url = URL.parse(raw);
  if (!url) throw new WebhookRefused(`webhook URL is not an absolute URL (got ${JSON.stringify(raw.slice(0, 100))})`);
  if (url.protocol === "http:") {
    if (!policy.allowHttp) {
      throw new WebhookRefused("webhook URL must use https (set WEBHOOK_ALLOW_HTTP=true to allow http)");
    }
  } else if (url.protocol !== "https:") {
    throw new WebhookRefused(`webhook URL must use https (got ${url.protocol.slice(0, -1)})`);
  }
  if (url.username !== "" || url.password !== "") {
    throw new WebhookRefused("webhook URL must not contain a user name or password");
  }
  if (url.hostname === "") throw new WebhookRefused("webhook URL has no host");
  if (!policy.allowPrivate) {
    const literal = ipLiteralOf(url);
    if (literal !== undefined && !isPublicAddress(literal)) refusePrivate(literal);
    if (isLocalhostName(url.hostname)) refusePrivate(url.hostname);
  }
  return url;
}

/**
 * The A and AAAA records of `host` (IPv4 first), through the system's DNS
 * configuration. A family with no records is fine; both empty resolves to [].
 * @throws {ConnectionError} when a lookup fails otherwise (retryable).
 * @throws {PermissionDenied} when this process may not use DNS.
 */
export async function lookupHost(host: string): Promise<string[]> {
  const answers = await Promise.allSettled([Deno.resolveDns(host, "A"), Deno.resolveDns(host, "AAAA")]);
  const addresses: string[] = [];
  for (const answer of answers) {
    if (answer.status === "fulfilled") addresses.push(...answer.value);
    else if (isNotCapable(answer.reason)) {
      throw new PermissionDenied(`this process's permission set does not allow DNS lookups of ${host}`, {
        cause: answer.reason,
      });
    } else if (!(answer.reason instanceof Deno.errors.NotFound)) {
      throw new ConnectionError(`DNS lookup of ${host} failed: ${(answer.reason as Error).message}`, {
        cause: answer.reason,
      });
    }
  }
  return addresses;
}

/**
 * At send time: applies {@linkcode checkWebhookUrl}'s rules again, resolves
 * the host and refuses if any address is private (a name may point anywhere,
 * and may change between POST time and now). The caller must connect to one
 * of the returned addresses, never resolve the name again: that is what
 * keeps DNS rebinding from swapping in a private address after the check.
 * @throws {WebhookRefused} for a refused URL or address (permanent).
 * @throws {ConnectionError} when nothing resolved (DNS may be down: retryable).
 */
export async function resolvePublic(
  url: URL,
  policy: WebhookUrlPolicy,
  resolve: ResolveHost = lookupHost,
): Promise<string[]> {
  const checked = checkWebhookUrl(url.href, policy);
  const literal = ipLiteralOf(checked);
  const addresses = literal !== undefined
    ? [literal]
    : isLocalhostName(checked.hostname)
    ? ["127.0.0.1", "::1"]
    : await resolve(checked.hostname);
  if (addresses.length === 0) {
    throw new ConnectionError(`webhook host ${checked.hostname} did not resolve to any address`);
  }
  // Connecting to a name instead of an address would resolve it again, behind the check.
  const notIp = addresses.find((address) => !isIpAddress(address));
  if (notIp !== undefined) {
    throw new WebhookRefused(
      `webhook URL host ${checked.hostname} resolved to something that is not an IP address (${
        JSON.stringify(notIp.slice(0, 100))
      })`,
    );
  }
  if (!policy.allowPrivate) {
    const bad = addresses.find((address) => !isPublicAddress(address));
    if (bad !== undefined) {
      throw new WebhookRefused(
        `webhook URL host ${checked.hostname} resolves to a private or loopback address (${bad})`,
      );
    }
  }
  return addresses;
}
