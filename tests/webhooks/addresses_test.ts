import assert from "node:assert/strict";
import { isRetryable } from "../../src/retry/classify.ts";
import { ConnectionError } from "../../src/retry/errors.ts";
import {
  checkWebhookUrl,
  isPublicAddress,
  resolvePublic,
  WebhookRefused,
  type WebhookUrlPolicy,
} from "../../src/webhooks/addresses.ts";

const STRICT: WebhookUrlPolicy = { allowHttp: false, allowPrivate: false };
const LAX: WebhookUrlPolicy = { allowHttp: true, allowPrivate: true };

/** A resolver that answers from a table and counts its lookups. */
function fakeResolver(table: Record<string, string[]>) {
  const lookups: string[] = [];
  return {
    lookups,
    resolve: (host: string) => {
      lookups.push(host);
      return Promise.resolve(table[host] ?? []);
    },
  };
}

function refusedWith(pattern: RegExp) {
  return (error: unknown) => {
    assert.ok(error instanceof WebhookRefused, `expected WebhookRefused, got ${error}`);
    assert.match(error.message, pattern);
    assert.equal(isRetryable(error), false);
    return true;
  };
}

Deno.test("isPublicAddress() accepts public IPv4 and IPv6 addresses", () => {
  for (
    const ip of [
      "1.1.1.1",
      "8.8.8.8",
      "93.184.216.34",
      "172.32.0.1",
      "100.128.0.1",
      "192.0.3.1",
      "223.255.255.255",
      "2606:4700:4700::1111",
      "2a00:1450:4001:82a::200e",
      "::ffff:8.8.8.8",
      "::ffff:808:808",
      "64:ff9b::8.8.8.8",
      "2002:808:808::1",
    ]
  ) assert.equal(isPublicAddress(ip), true, ip);
});

Deno.test("isPublicAddress() refuses every private, loopback, link-local and reserved IPv4 block", () => {
  for (
    const ip of [
      "0.0.0.0",
      "0.255.255.255",
      "10.0.0.1",
      "10.255.255.255",
      "100.64.0.1",
      "100.127.255.255",
      "127.0.0.1",
      "127.1.2.3",
      "169.254.169.254",
      "172.16.0.1",
      "172.31.255.255",
      "192.0.0.8",
      "192.0.2.1",
      "192.168.1.1",
      "198.18.0.1",
      "198.19.255.255",
      "198.51.100.7",
      "203.0.113.9",
      "224.0.0.1",
      "239.255.255.250",
      "240.0.0.1",
      "255.255.255.255",
    ]
  ) assert.equal(isPublicAddress(ip), false, ip);
});

Deno.test("isPublicAddress() refuses special IPv6 ranges and judges embedded IPv4 by itself", () => {
  for (
    const ip of [
      "::",
      "::1",
      "0:0:0:0:0:0:0:1",
      "fc00::1",
      "fd12:3456:789a::1",
      "fe80::1",
      "febf::1",
      "ff02::1",
      "2001:db8::1",
      "100::1",
      "::ffff:127.0.0.1",
      "::ffff:7f00:1",
      "::ffff:169.254.169.254",
      "::FFFF:A9FE:A9FE",
      "::ffff:10.0.0.1",
      "64:ff9b::127.0.0.1",
      "64:ff9b::a9fe:a9fe",
      "2002:7f00:1::1",
      "::127.0.0.1",
    ]
  ) assert.equal(isPublicAddress(ip), false, ip);
});

Deno.test("isPublicAddress() treats anything unparseable as not public", () => {
  for (
    const ip of [
      "",
      "localhost",
      "example.com",
      "1.2.3",
      "1.2.3.4.5",
      "256.1.1.1",
      "01.2.3.4",
      "0x7f.0.0.1",
      "2130706433",
      " 8.8.8.8",
      "[2606:4700::1111]",
      "2606:4700::1111%eth0",
      "fe80::1%1",
      "1::2::3",
      "1:2:3:4:5:6:7:8:9",
      "1:2:3:4:5:6:7:8::",
      ":1::2",
      "12345::1",
      "::ffff:999.0.0.1",
      "1.2.3.4::",
      "g::1",
    ]
  ) assert.equal(isPublicAddress(ip), false, JSON.stringify(ip));
});

Deno.test("checkWebhookUrl() accepts a public https URL and returns it parsed", () => {
  const url = checkWebhookUrl("https://hooks.example.com:8443/in?tenant=a", STRICT);
  assert.equal(url.hostname, "hooks.example.com");
  assert.equal(url.port, "8443");
  assert.equal(checkWebhookUrl("https://8.8.8.8/x", STRICT).hostname, "8.8.8.8");
  assert.equal(checkWebhookUrl("https://[2606:4700::1111]/x", STRICT).hostname, "[2606:4700::1111]");
});

Deno.test("checkWebhookUrl() refuses http unless allowHttp, and says how to allow it", () => {
  assert.throws(() => checkWebhookUrl("http://hooks.example.com/", STRICT), refusedWith(/WEBHOOK_ALLOW_HTTP=true/));
  assert.equal(checkWebhookUrl("http://hooks.example.com/", { ...STRICT, allowHttp: true }).protocol, "http:");
  assert.throws(() => checkWebhookUrl("ftp://hooks.example.com/", LAX), refusedWith(/must use https \(got ftp\)/));
  assert.throws(() => checkWebhookUrl("javascript:alert(1)", LAX), refusedWith(/must use https/));
});

Deno.test("checkWebhookUrl() refuses relative, credentialed and overlong URLs", () => {
  assert.throws(() => checkWebhookUrl("/hooks", LAX), refusedWith(/not an absolute URL/));
  assert.throws(() => checkWebhookUrl("hooks.example.com/x", LAX), refusedWith(/not an absolute URL/));
  assert.throws(() => checkWebhookUrl("https://user:pw@hooks.example.com/", LAX), refusedWith(/user name or password/));
  assert.throws(() => checkWebhookUrl("https://user@hooks.example.com/", LAX), refusedWith(/user name or password/));
  const long = `https://hooks.example.com/${"a".repeat(2048)}`;
  assert.throws(() => checkWebhookUrl(long, LAX), refusedWith(/too long \(2074 characters, at most 2048\)/));
});

Deno.test("checkWebhookUrl() refuses private IP literals in every spelling, and localhost names", () => {
  const cases: Array<[string, RegExp]> = [
    ["https://127.0.0.1/", /private or loopback address \(127\.0\.0\.1\)/],
    ["https://2130706433/", /\(127\.0\.0\.1\)/],
    ["https://0x7f.1/", /\(127\.0\.0\.1\)/],
    ["https://169.254.169.254/latest/meta-data/", /\(169\.254\.169\.254\)/],
    ["https://10.1.2.3:8443/", /\(10\.1\.2\.3\)/],
    ["https://[::1]/", /\(::1\)/],
    ["https://[::ffff:127.0.0.1]/", /\(::ffff:7f00:1\)/],
    ["https://[fd00::1]/", /\(fd00::1\)/],
    ["https://localhost/", /\(localhost\)/],
    ["https://LOCALHOST./", /\(localhost\.\)/],
    ["https://api.localhost:3000/", /\(api\.localhost\)/],
  ];
  for (const [raw, pattern] of cases) {
    assert.throws(() => checkWebhookUrl(raw, STRICT), refusedWith(pattern), raw);
    assert.equal(checkWebhookUrl(raw, { ...STRICT, allowPrivate: true }).href, new URL(raw).href);
  }
});

Deno.test("resolvePublic() returns an IP literal itself without asking DNS", async () => {
  const dns = fakeResolver({});
  assert.deepEqual(await resolvePublic(new URL("https://8.8.8.8/"), STRICT, dns.resolve), ["8.8.8.8"]);
  assert.deepEqual(await resolvePublic(new URL("https://[2606:4700::1111]/"), STRICT, dns.resolve), [
    "2606:4700::1111",
  ]);
  assert.deepEqual(await resolvePublic(new URL("http://127.0.0.1:8080/"), LAX, dns.resolve), ["127.0.0.1"]);
  assert.deepEqual(dns.lookups, []);
});

Deno.test("resolvePublic() maps localhost names to loopback, allowed only with allowPrivate", async () => {
  const dns = fakeResolver({ "localhost": ["10.9.9.9"] });
  assert.deepEqual(await resolvePublic(new URL("http://app.localhost/"), LAX, dns.resolve), ["127.0.0.1", "::1"]);
  await assert.rejects(resolvePublic(new URL("https://localhost/"), STRICT, dns.resolve), refusedWith(/localhost/));
  assert.deepEqual(dns.lookups, []);
});

Deno.test("resolvePublic() returns the resolved addresses when all are public", async () => {
  const dns = fakeResolver({ "hooks.example.com": ["93.184.216.34", "2606:2800:220:1::1"] });
  const addresses = await resolvePublic(new URL("https://hooks.example.com/in"), STRICT, dns.resolve);
  assert.deepEqual(addresses, ["93.184.216.34", "2606:2800:220:1::1"]);
  assert.deepEqual(dns.lookups, ["hooks.example.com"]);
});

Deno.test("resolvePublic() refuses a name when any one of its addresses is private", async () => {
  const dns = fakeResolver({
    "rebind.example.com": ["93.184.216.34", "169.254.169.254"],
    "v6.example.com": ["2606:2800:220:1::1", "::ffff:10.0.0.1"],
  });
  await assert.rejects(
    resolvePublic(new URL("https://rebind.example.com/"), STRICT, dns.resolve),
    refusedWith(/rebind\.example\.com resolves to a private or loopback address \(169\.254\.169\.254\)/),
  );
  await assert.rejects(
    resolvePublic(new URL("https://v6.example.com/"), STRICT, dns.resolve),
    refusedWith(/\(::ffff:10\.0\.0\.1\)/),
  );
  assert.deepEqual(await resolvePublic(new URL("https://rebind.example.com/"), LAX, dns.resolve), [
    "93.184.216.34",
    "169.254.169.254",
  ]);
});

Deno.test("resolvePublic() refuses a resolver answer that is not an IP address, even with allowPrivate", async () => {
  const dns = fakeResolver({ "hooks.example.com": ["internal.corp"] });
  await assert.rejects(
    resolvePublic(new URL("https://hooks.example.com/"), LAX, dns.resolve),
    refusedWith(/not an IP address \("internal\.corp"\)/),
  );
});

Deno.test("resolvePublic() fails retryably when the name resolves to nothing", async () => {
  const dns = fakeResolver({});
  await assert.rejects(resolvePublic(new URL("https://gone.example.com/"), STRICT, dns.resolve), (error) => {
    assert.ok(error instanceof ConnectionError);
    assert.match(error.message, /gone\.example\.com did not resolve/);
    assert.equal(isRetryable(error), true);
    return true;
  });
});

Deno.test("resolvePublic() repeats checkWebhookUrl's rules before any lookup", async () => {
  const dns = fakeResolver({ "hooks.example.com": ["93.184.216.34"] });
  await assert.rejects(
    resolvePublic(new URL("http://hooks.example.com/"), STRICT, dns.resolve),
    refusedWith(/must use https/),
  );
  await assert.rejects(
    resolvePublic(new URL("https://u:p@hooks.example.com/"), STRICT, dns.resolve),
    refusedWith(/user name or password/),
  );
  assert.deepEqual(dns.lookups, []);
});
